"""Reading versions back: what a version reference resolves to, and the folder the engine
loads it from (fetched and decrypted when its files are not a plain folder on this server).
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.artifacts import stores
from treadle.errors import InvalidRequestError
from treadle.server.registry.names import is_ref
from treadle.server.registry.versions import get_version, version_by_tinker_path
from treadle.server.storage.database import Store
from treadle.server.storage.rows import CheckpointRow, VersionRow

# what a kind holds for the engine: load_state (adapter + optimizer) or an adapter
ENGINE_TYPE = {"state": "training", "sampler": "sampler"}


def packages_root(config: Any) -> Path:
    """Where versions go when a group has no output_path: <data_dir>/packages."""
    return Path(config.data_dir).resolve() / "packages"


def resolve_version(db: Store, tenant_id: str, ref: str, kinds: tuple[str, ...] = ()) -> str:
    """`GROUP:N` / `GROUP:latest` → the tinker:// path of the version when its checkpoint
    is on this server, else its location (a server folder or s3:// prefix).

    `latest` means the newest adapter-bearing version (sampler or state) unless `kinds`
    says otherwise. NotFoundError when unknown or another tenant's.
    """
    row = get_version(db, tenant_id, ref, kinds or ("sampler", "state"))
    if row.tinker_path and not row.encrypted:
        # the tinker path holds this version only if no later save overwrote it
        newest = version_by_tinker_path(db, tenant_id, row.tinker_path)
        ckpt = db.get(CheckpointRow, row.tinker_path)
        if newest is not None and newest.id == row.id and ckpt is not None:
            if Path(ckpt.dir).is_dir():
                return row.tinker_path
    return row.location


@dataclass
class LoadSource:
    """A checkpoint folder the engine can load, and what it holds."""

    dir: str
    checkpoint_type: str  # training | sampler
    base_model: str
    lora_config: dict
    cleanup: bool  # a temporary copy, deleted after loading


def fetch(row: VersionRow, dest: Path, key: bytes | None) -> None:
    stores.open_location(row.location).get_files(dest, key)


def cache_dir(packages_root: Path) -> Path:
    return packages_root.parent / "cache" / uuid.uuid4().hex


def load_source(
    db: Store,
    packages_root: Path,
    tenant_id: str,
    path: str,
    key: bytes | None,
    optimizer: bool,
) -> LoadSource | None:
    """What load_weights loads for `path`: a version reference, or the tinker path of a
    version whose plain folder is not on this server (encrypted, or in S3). None: a plain
    tinker:// checkpoint, for the usual lookup. Runs off the event loop (it may download)."""
    if is_ref(path):
        kinds = ("state",) if optimizer else ("sampler", "state")
        row = get_version(db, tenant_id, path, kinds)
    elif path.startswith("tinker://"):
        row = version_by_tinker_path(db, tenant_id, path)
        if row is None:
            return None
        ckpt = db.get(CheckpointRow, path)
        if ckpt is not None and Path(ckpt.dir).is_dir():
            return None
    else:
        return None
    if row.kind == "merged":
        raise InvalidRequestError(
            f"path: {row.group_name}:{row.version} is a merged model; load an adapter "
            "(sampler) or state version"
        )
    local = stores.open_location(row.location).local_dir()
    if local is not None and not row.encrypted:
        folder, cleanup = str(local), False
    else:
        target = cache_dir(packages_root)
        try:
            fetch(row, target, key)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        folder, cleanup = str(target), True
    return LoadSource(
        dir=folder,
        checkpoint_type=ENGINE_TYPE[row.kind],
        base_model=row.base_model,
        lora_config=row.lora_config or {},
        cleanup=cleanup,
    )
