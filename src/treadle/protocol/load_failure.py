"""A worker that cannot load its model: the one-line reason, and how it reaches the API.

Some start-up failures do not go away by starting the worker again: a model path that is not
there or not readable, an architecture transformers does not know, a tokenizer that does not
load, weights that do not fit in memory. A worker process that fails so writes the reason,
one line, to the file its supervisor names (LOAD_FAILURE_ENV) and exits with
EXIT_LOAD_FAILED; a worker thread's engine factory raises. The supervisor does not start it
again if the model never served (`treadle serve` stops with the reason), and backs off and
gives up after a few tries if it did (the model is reported down, its requests fail with the
reason): treadle.server.engines.supervisor.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

LOAD_FAILURE_ENV = "TREADLE_LOAD_FAILURE_FILE"  # its path, set by the supervisor
EXIT_LOAD_FAILED = 78  # sysexits' EX_CONFIG: a worker's exit status when its model cannot load

# Errors a user's mistake (or a machine too small) raises while a model loads: the reason is
# their message, and no traceback is printed for them.
EXPECTED = (OSError, ValueError, KeyError, ImportError, MemoryError)


def reason_of(error: BaseException, name: str, path: str) -> str:
    """One line: what failed loading model `name` from `path`, and what to do about it."""
    text = _first_sentence(str(error)) or type(error).__name__
    head = f"cannot load model {name!r} from {path!r}"
    low = text.lower()
    if out_of_memory(error):
        asked = re.search(r"tried to allocate [^.(]+", str(error))
        what = asked.group(0).strip() if asked else text
        return (
            f"{head}: not enough memory for its weights ({what}); free memory, serve a smaller "
            "model, or use --dtype bfloat16"
        )
    if "model path must be" in low:
        return f"{head}: {text}; give --model NAME=PATH with PATH a model folder or .gguf file"
    if "model type" in low or "model_type" in low or "does not recognize" in low:
        return (
            f"{head}: unsupported architecture ({text}); serve a model whose config.json has a "
            "model_type this transformers version knows"
        )
    if "tokenizer" in low:
        return (
            f"{head}: its tokenizer does not load ({text}); put the tokenizer's files "
            "(tokenizer.json, tokenizer_config.json) in the model folder"
        )
    if isinstance(error, PermissionError):
        return f"{head}: {text}; make the files readable by the server's user"
    return f"{head}: {type(error).__name__}: {text}"


def _first_sentence(message: str) -> str:
    """transformers' messages run to paragraphs: their first line, or sentence, says it."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(text) > 120 and ". " in text[40:]:
        text = text[: text.index(". ", 40) + 1]
    return text[:400]


def out_of_memory(error: BaseException) -> bool:
    """MemoryError, torch's allocators' errors (CPU: a RuntimeError; CUDA: OutOfMemoryError)."""
    low = str(error).lower()
    return (
        isinstance(error, MemoryError)
        or type(error).__name__ == "OutOfMemoryError"
        or any(
            s in low for s in ("out of memory", "can't allocate memory", "cannot allocate memory")
        )
    )


def expected(error: BaseException) -> bool:
    """An error a user's mistake or a small machine explains: said in one line, no traceback."""
    return isinstance(error, EXPECTED) or out_of_memory(error)


def write_reason(reason: str) -> None:
    """In a worker process: leave the reason where the supervisor reads it (if it named a
    place; `treadle worker` started by hand just exits with the status)."""
    path = os.environ.get(LOAD_FAILURE_ENV)
    if path:
        Path(path).write_text(reason + "\n")


def read_reason(path: Path) -> str | None:
    """The supervisor's side: the reason a worker left, or None."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text.splitlines()[0] if text else None
