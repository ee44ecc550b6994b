"""Checkpoint names, tinker:// paths, and folders written atomically under data_dir/artifacts.

tinker://<run_id>/weights/<name>          training state (adapter + optimizer): save_state
tinker://<run_id>/sampler_weights/<name>  PEFT adapter: save_weights_for_sampler
tinker://<run_id>/external_weights/<name> the same adapter, for file download
on disk: <data_dir>/artifacts/<run_id>/<weights|sampler_weights|external_weights>/<name>/
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from treadle.errors import InvalidRequestError

log = logging.getLogger("treadle.artifacts")

# Folders a write makes beside its target, gone once it commits: what an interrupted write
# leaves (atomic_dir, LocalStore and CheckpointWriter name them so).
LEFTOVER_PREFIXES = (".tmp-", ".old-", ".merged-")
SCRATCH_DIRS = (".refresh",)  # per-write folders under the artifacts root
LEFTOVER_DEPTH = 5  # artifacts/<run>/<segment>/<name>; packages/<tenant>/<group>/<version>

SEGMENT_OF_TYPE = {
    "training": "weights",
    "sampler": "sampler_weights",
    "external": "external_weights",  # save_weights_external: the adapter, for download
}
TYPE_OF_SEGMENT = {v: k for k, v in SEGMENT_OF_TYPE.items()}


def check_name(name: str | None, field: str = "path") -> str:
    """A checkpoint name is one path segment: no '/', no '..', not empty."""
    if not name or "/" in name or "\\" in name or ".." in name or name.startswith("."):
        raise InvalidRequestError(
            f"{field}: a checkpoint name must be one non-empty path segment without '/', "
            f"'..' or a leading '.', got {name!r}"
        )
    return name


def tinker_path(run_id: str, checkpoint_type: str, name: str) -> str:
    return f"tinker://{run_id}/{SEGMENT_OF_TYPE[checkpoint_type]}/{name}"


def parse_tinker_path(path: str, field: str = "path") -> tuple[str, str, str]:
    """→ (run_id, checkpoint_type, name); the protocol wants exactly 3 segments."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in TYPE_OF_SEGMENT or not parts[0]:
        raise InvalidRequestError(
            f"{field}: expected tinker://<run_id>/weights/<name>, "
            f"tinker://<run_id>/sampler_weights/<name> or "
            f"tinker://<run_id>/external_weights/<name>, got {path!r}"
        )
    check_name(parts[2], field)
    return parts[0], TYPE_OF_SEGMENT[parts[1]], parts[2]


def checkpoint_dir(root: Path, run_id: str, checkpoint_type: str, name: str) -> Path:
    return root / run_id / SEGMENT_OF_TYPE[checkpoint_type] / name


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp folder beside `final`; on success it replaces `final` by rename.

    An interrupted write leaves only a `.tmp-*` folder, never a half checkpoint under the
    real name.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if final.exists():
            old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            final.rename(old)
        tmp.rename(final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_state_folders(folders: list[str]) -> None:
    """Delete state snapshot folders no row names any more, and the folders that held them
    once empty (a model's `samplers/`, then the model's own)."""
    parents = set()
    for folder in folders:
        path = Path(folder)
        shutil.rmtree(path, ignore_errors=True)
        parents.add(path.parent)
        if path.parent.name == "samplers":
            parents.add(path.parent.parent)
    for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):  # not empty: another snapshot still lives there
            parent.rmdir()


def unnamed_state_folders(state_root: Path, named: set[str]) -> list[str]:
    """The state snapshot folders under `state_root` (`<model>/state-*`,
    `<model>/samplers/*`) that are not in `named` (compared resolved): what a snapshot
    written but never recorded left (a crash between the two, or one that arrived late)."""
    keep = {Path(folder).resolve() for folder in named}
    found = [*state_root.glob("*/state-*"), *state_root.glob("*/samplers/*")]
    return [
        str(path)
        for path in found
        if path.is_dir() and not path.name.startswith(".") and path.resolve() not in keep
    ]


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove_leftovers(roots: list[Path], scratch: list[Path]) -> list[Path]:
    """At start-up (nothing is being written): remove what interrupted writes left under
    `roots` (the artifacts and packages folders) and the `scratch` folders (download and
    upload caches) whole; → what was removed.

    A `.old-<name>-*` folder whose `<name>` is missing is the previous copy of a checkpoint
    an overwrite had moved aside when it was stopped: it is renamed back, not removed.
    """
    removed = []
    for folder in scratch:
        if folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    for root in roots:
        removed += _sweep(root, LEFTOVER_DEPTH)
    if removed:
        log.warning("removed %d leftovers of interrupted writes: %s", len(removed), removed[:5])
    return removed


def _sweep(folder: Path, depth: int) -> list[Path]:
    if depth == 0 or not folder.is_dir():
        return []
    removed = []
    with os.scandir(folder) as entries:
        dirs = sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
    for name in dirs:
        path = folder / name
        if name.startswith(".old-") and not (target := folder / _final_name(name)).exists():
            path.rename(target)
            log.warning("restored %s from its interrupted overwrite", target)
        elif name.startswith(LEFTOVER_PREFIXES) or name in SCRATCH_DIRS:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif not name.startswith("."):
            removed += _sweep(path, depth - 1)
    return removed


def _final_name(leftover: str) -> str:
    """`.old-<name>-<8 hex>` → `<name>`."""
    return leftover.removeprefix(".old-").rsplit("-", 1)[0]
