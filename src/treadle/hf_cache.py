"""Place a served model's tokenizer in a local Hugging Face cache under its served name.

The tinker SDK and tinker-cookbook load tokenizers by model name with
`AutoTokenizer.from_pretrained(NAME)`, which asks the Hugging Face hub. A self-hosted model
has no hub repository, so this writes the hub cache layout for it instead:

    <cache>/models--<org>--<name>/refs/main            the revision below
    <cache>/models--<org>--<name>/snapshots/<rev>/...  tokenizer and config files

With `HF_HUB_OFFLINE=1` (and `HF_HOME` or `HF_HUB_CACHE` pointing at the same cache),
`AutoTokenizer.from_pretrained(NAME)` then loads the files without any network access.

    treadle hf-cache --model treadle/tiny-llama=.models/tiny-llama
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from treadle.errors import InvalidRequestError

# Weight files are never copied: the client side only needs to tokenize.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
WEIGHT_INDEX_SUFFIX = ".index.json"


def default_cache_dir() -> Path:
    """The hub cache huggingface_hub reads: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def repo_folder_name(name: str) -> str:
    """`org/name` → `models--org--name`, the hub cache's folder for a model repository."""
    parts = name.split("/")
    if not name or len(parts) > 2 or any(not p or p in (".", "..") for p in parts):
        raise InvalidRequestError(
            f"name: expected a model name like 'org/name' or 'name', got {name!r}"
        )
    return "models--" + "--".join(parts)


def tokenizer_files(model_dir: Path) -> list[Path]:
    """Every top-level file of model_dir except weights: tokenizer, chat template, configs."""
    files = []
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or path.name.startswith("."):
            continue
        if path.name.endswith(WEIGHT_SUFFIXES) or path.name.endswith(WEIGHT_INDEX_SUFFIX):
            continue
        files.append(path)
    return files


def place_in_hf_cache(
    name: str, model_dir: str | Path, cache_dir: str | Path | None = None
) -> Path:
    """Copy model_dir's tokenizer and config files into the hub cache as repository `name`.

    The revision is a hash of the copied files, so placing the same folder twice is a no-op
    and placing a changed folder makes a new snapshot that refs/main points at.
    Returns the snapshot folder.
    """
    src = Path(model_dir).expanduser()
    if src.is_file() and src.suffix == ".gguf":  # its tokenizer, extracted once
        from treadle.engine.model_files import tokenizer_folder

        src = tokenizer_folder(src, Path(cache_dir or default_cache_dir()) / ".treadle-gguf")
    if not src.is_dir():
        raise InvalidRequestError(f"model_dir: {str(src)!r} is not a folder or a .gguf file")
    files = tokenizer_files(src)
    if not any(f.name.startswith("tokenizer") for f in files):
        raise InvalidRequestError(
            f"model_dir: {str(src)!r} holds no tokenizer files (tokenizer.json, "
            f"tokenizer_config.json, ...); found {[f.name for f in files]}"
        )
    digest = hashlib.sha1()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    revision = digest.hexdigest()  # 40 hex digits, the shape of a commit hash

    repo = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    repo = repo / repo_folder_name(name)
    snapshot = repo / "snapshots" / revision
    if not snapshot.is_dir():
        tmp = repo / "snapshots" / f".{revision}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in files:
            shutil.copy2(f, tmp / f.name)
        tmp.rename(snapshot)  # readers never see a half-written snapshot
    refs = repo / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / "main").write_text(revision)
    return snapshot


def place_models(models: dict[str, str | Path], cache_dir: str | Path | None = None) -> list[Path]:
    """place_in_hf_cache for each NAME → folder; → the snapshot folders, in order."""
    return [place_in_hf_cache(name, path, cache_dir) for name, path in models.items()]
