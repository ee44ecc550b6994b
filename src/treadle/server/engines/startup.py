"""What stops the server at start, with one line that says why: the served models are checked
in the API process before any worker starts, and a worker that cannot load its model ends
the start-up (treadle.server.engines.workers.Workers.start) instead of being started forever.

Checked here, for each served model: its path is a model folder with config.json or a .gguf
file; a folder's architecture is one transformers can load as a causal LM; its tokenizer
loads. What only loading the weights tells (not enough memory, corrupt weights) the worker
says (treadle.protocol.load_failure).
"""

from __future__ import annotations

from pathlib import Path

from treadle.protocol.load_failure import reason_of
from treadle.server.config import ServerConfig


class CannotStart(RuntimeError):
    """The server cannot serve: the message is the one line that says why and what to do."""


class StartCancelled(RuntimeError):
    """A signal stopped the server while it was starting."""


def check_models(config: ServerConfig) -> dict[str, Path]:
    """→ each served model's tokenizer folder; CannotStart naming the first model that cannot
    be served, and why."""
    return {name: check_model(name, path, config) for name, path in config.models.items()}


def check_model(name: str, path: str, config: ServerConfig) -> Path:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from treadle.engine.models import model_source, tokenizer_folder

    try:
        folder, gguf = model_source(path)
        if gguf is None:
            model_type = AutoConfig.from_pretrained(folder, local_files_only=True).model_type
            if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
                raise ValueError(
                    f"model_type {model_type!r} is not a causal language model transformers "
                    "can load"
                )
        tokenizers = tokenizer_folder(path, Path(config.data_dir) / "tokenizers")
        try:
            AutoTokenizer.from_pretrained(tokenizers, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - whatever transformers says, said once
            raise ValueError(f"tokenizer: {_first_line(e)}") from e
    except CannotStart:
        raise
    except Exception as e:  # noqa: BLE001 - the model is not served: say why, in one line
        raise CannotStart(reason_of(e, name, path)) from e
    return tokenizers


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
