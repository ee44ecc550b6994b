"""What stops the server at start, with one line that says why: the served models are checked
in the API process before any worker starts, and a worker that cannot load its model ends
the start-up (treadle.server.engines.workers.Workers.start) instead of being started forever.

Checked here, for each served model: its path is a model folder with config.json or a .gguf
file. Its worker checks, before loading the weights, that its architecture is one
transformers can load as a causal LM and that its tokenizer loads; what only loading the
weights tells (not enough memory, corrupt weights) it says too (treadle.protocol.load_failure).
Either way the server stops before it listens, with that one line.
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
    """→ the model's tokenizer folder (a GGUF's is extracted once, with transformers); what
    only transformers can say (its architecture, its tokenizer) its worker checks, before it
    loads the weights (treadle.engine.model_files.check_loadable), so that this process
    never imports torch."""
    from treadle.engine.model_files import tokenizer_folder

    try:
        return tokenizer_folder(path, Path(config.data_dir) / "tokenizers")
    except Exception as e:  # noqa: BLE001 - the model is not served: say why, in one line
        raise CannotStart(reason_of(e, name, path)) from e
