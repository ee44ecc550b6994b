"""Importing a PEFT LoRA adapter made elsewhere (a tar of its folder) as a sampler version.

The archive comes from a tenant: it is read member by member, and only the files of a PEFT
adapter folder (ADAPTER_FILES, each at most once, at the top, regular files) are written,
within a size and count budget. A link, device, folder, absolute or `..` path, or a second
copy of a file refuses the whole archive; any other plain file beside the adapter's (a
tokenizer, a trainer's state) is passed over, never written. The folder must then be a
loadable PEFT adapter of a served model: its config parses and names a LoRA whose rank the
model can take, and the engine loads its weights (a dry run, freed at once). Only then is
anything stored and registered; a refusal leaves nothing behind.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path
from typing import Any

from treadle.errors import InvalidRequestError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TREADLE_META = "treadle_adapter.json"  # what Treadle itself writes beside them
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, TREADLE_META, "README.md")
MAX_MEMBERS = 64
_PLAIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def extract_adapter(archive: Path, folder: Path, max_bytes: int) -> dict[str, Any]:
    """Write the adapter's files of the archive into `folder`, checked one by one;
    → adapter_config."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, mode="r:") as tar:
            seen: set[str] = set()
            total = 0
            for count, m in enumerate(iter(tar.next, None)):  # never the whole index at once
                if count >= MAX_MEMBERS:
                    raise InvalidRequestError(
                        f"body: an adapter archive holds at most {MAX_MEMBERS} members"
                    )
                name = m.name.removeprefix("./")
                if m.isdir() and name in ("", "."):
                    continue
                if not m.isreg() or m.issparse() or not _PLAIN.match(name) or name in seen:
                    raise InvalidRequestError(
                        f"body: archive member {m.name!r} is not a plain file at the top of the "
                        f"adapter folder (an archive holds regular files, each once: "
                        f"{list(ADAPTER_FILES)}; no folders, links or paths)"
                    )
                seen.add(name)
                if name not in ADAPTER_FILES:
                    continue  # not part of the adapter: never written
                total += m.size
                if total > max_bytes:
                    raise InvalidRequestError(f"body: the archive's files exceed {max_bytes} bytes")
                src = tar.extractfile(m)
                with open(folder / name, "wb") as out:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
    except tarfile.TarError as e:
        raise InvalidRequestError(f"body: expected a tar of the adapter folder: {e}") from e
    return adapter_config(folder)


def check_rank(config: dict[str, Any], max_rank: int, model: str) -> int:
    """The adapter's rank, within what the model takes (checked before any weight loads)."""
    rank = int(config.get("r", 8))
    if rank > max_rank:
        raise InvalidRequestError(
            f"body: {ADAPTER_CONFIG}: r {rank} exceeds the largest useful rank of {model!r}, "
            f"{max_rank} (the width of its layers)"
        )
    return rank


def adapter_config(folder: Path) -> dict[str, Any]:
    """The folder's adapter_config.json, checked to describe a plain PEFT LoRA."""
    found = sorted(p.name for p in folder.iterdir())
    if ADAPTER_CONFIG not in found or ADAPTER_WEIGHTS not in found:
        raise InvalidRequestError(
            f"body: a PEFT adapter folder holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}; "
            f"found {found}"
        )
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"body: {ADAPTER_CONFIG} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise InvalidRequestError(f"body: {ADAPTER_CONFIG} must be a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidRequestError(
            f"body: {ADAPTER_CONFIG}: peft_type must be LORA, got {config.get('peft_type')!r}"
        )
    for key in ("r", "lora_alpha"):
        value = config.get(key, 8)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 2**20:
            raise InvalidRequestError(
                f"body: {ADAPTER_CONFIG}: {key} must be a positive number, got {value!r}"
            )
    if (folder / TREADLE_META).is_file():
        _check_meta(folder / TREADLE_META, config)
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise InvalidRequestError(
            f"body: {ADAPTER_CONFIG}: base_model_name_or_path must be a string, got {base!r}"
        )
    return config


def _check_meta(path: Path, config: dict[str, Any]) -> None:
    """Treadle's own description of the adapter: its rank must be the config's."""
    try:
        spec = json.loads(path.read_text())["spec"]
        rank = spec["rank"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise InvalidRequestError(
            f"body: {TREADLE_META} is not a Treadle adapter spec ({e})"
        ) from e
    if not isinstance(spec, dict) or rank != config.get("r", rank) or type(rank) is not int:
        raise InvalidRequestError(
            f"body: {TREADLE_META}: rank {rank!r} does not match {ADAPTER_CONFIG}'s r "
            f"{config.get('r')!r}"
        )
