"""Importing a PEFT LoRA adapter made elsewhere (a tar of its folder) as a sampler version.

The archive comes from a tenant: it is read member by member, and only regular files with
plain names are written (no links, devices, absolute or `..` paths, no nesting), within a
size and count budget. The folder must then be a loadable PEFT adapter of a served model:
its config parses and names a LoRA, and the engine loads its weights (a dry run, freed at
once). Only then is anything stored and registered; a refusal leaves nothing behind.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path
from typing import Any

from treadle.errors import InvalidRequestError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_MEMBERS = 16
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def extract_adapter(archive: bytes, folder: Path, max_bytes: int) -> dict[str, Any]:
    """Write the archive's files into `folder` (checked one by one); → adapter_config."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            members = tar.getmembers()
            if len(members) > MAX_MEMBERS:
                raise InvalidRequestError(
                    f"body: an adapter archive holds at most {MAX_MEMBERS} files, "
                    f"got {len(members)}"
                )
            total = 0
            for m in members:
                name = m.name.removeprefix("./")
                if m.isdir() and name in ("", "."):
                    continue
                if not m.isfile() or not _NAME.match(name):
                    raise InvalidRequestError(
                        f"body: archive member {m.name!r} is not a plain file at the top of "
                        "the adapter folder (only regular files with plain names are taken)"
                    )
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
    return config
