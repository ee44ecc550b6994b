"""Tokenizers come from the server that serves the model, never from a model hub.

`GET /api/v1/treadle/models/{name}/tokenizer` returns a flat zip of the model folder's
tokenizer files; they are written under `~/.cache/treadle/tokenizers/<name>/<digest>/` (TREADLE_CACHE_DIR
moves the root) and loaded with `transformers.AutoTokenizer` when it is installed, else with
the `tokenizers` library (wrapped to answer `encode` with a list of ids). The digest of the files names the folder, so a server that swaps a
model under the same name never meets a stale cache.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import threading
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.client.transport import Transport

_memo: dict[tuple[str, str], Any] = {}
_memo_lock = threading.Lock()


def cache_root() -> Path:
    env = os.environ.get("TREADLE_CACHE_DIR")
    base = Path(env) if env else Path.home() / ".cache" / "treadle"
    return base / "tokenizers"


def _safe_name(name: str) -> str:
    # keep "org/model" readable as nested folders, but never let a name climb out of the root
    parts = [
        re.sub(r"[^A-Za-z0-9._-]", "_", p) for p in name.split("/") if p not in ("", ".", "..")
    ]
    return "/".join(parts) or "_"


def _files_of(zip_bytes: bytes) -> dict[str, bytes]:
    """{filename: bytes} from the route's flat zip."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(zip_bytes))
    except zipfile.BadZipFile as exc:
        raise ValueError(f"tokenizer route: expected a zip, got {zip_bytes[:80]!r}") from exc
    out = {}
    with zf:
        for fname in zf.namelist():
            if "/" in fname or "\\" in fname or fname in ("", ".", ".."):
                raise ValueError(f"tokenizer route: unsafe file name {fname!r} in the zip")
            out[fname] = zf.read(fname)
    if not out:
        raise ValueError("tokenizer route: the zip holds no files")
    return out


def write_files(name: str, files: dict[str, bytes]) -> Path:
    """Store the files in their digest-named cache folder (atomically) and return it."""
    digest = hashlib.sha256()
    for fname in sorted(files):
        digest.update(fname.encode() + b"\0" + files[fname] + b"\0")
    folder = cache_root() / _safe_name(name) / digest.hexdigest()[:16]
    if not folder.exists():
        tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for fname, data in files.items():
            (tmp / fname).write_bytes(data)
        try:
            tmp.rename(folder)
        except OSError:  # another process won the race; its copy is identical
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
    return folder


class RawTokenizer:
    """The `tokenizers` library's Tokenizer with the calls a training loop makes of an HF
    tokenizer (`encode` → list of ids, `decode`, `len`), for installs without transformers."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def load_from_dir(folder: Path, use_transformers: bool = True) -> Any:
    """AutoTokenizer on the folder when transformers is installed, else a RawTokenizer."""
    if use_transformers:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            pass
        else:
            return AutoTokenizer.from_pretrained(str(folder))
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ImportError(
            "get_tokenizer needs `transformers` or `tokenizers` (pip install tokenizers)"
        ) from exc
    return RawTokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")))


def load_tokenizer(transport: Transport, name: str) -> Any:
    """Fetch (once per process and server), cache and load the tokenizer of `name`."""
    key = (transport.base_url, name)
    with _memo_lock:
        if key in _memo:
            return _memo[key]
    resp = transport.call(transport.request("GET", f"/api/v1/treadle/models/{name}/tokenizer"))
    tokenizer = load_from_dir(write_files(name, _files_of(resp.content)))
    with _memo_lock:
        _memo.setdefault(key, tokenizer)
        return _memo[key]
