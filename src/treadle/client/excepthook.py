"""One line, not a traceback, for the SDK errors a newcomer meets first.

An uncaught APIError that carries a `hint` (no server at the address, a wrong URL, a wrong or
missing API key, a base model the server does not serve: treadle.client.errors) ends the
script with one line on stderr that says what happened, what to do, and where in the
script it was raised; every other exception keeps Python's traceback. TREADLE_TRACEBACK=1
brings the traceback back for these too. Installed by the first ServiceClient, in front
of whatever hook was there (which still handles everything else).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from types import TracebackType

from treadle.client.errors import APIError

_PACKAGE = str(Path(__file__).resolve().parent.parent)  # treadle/


def install() -> None:
    """Put the hook in front of the current one (once)."""
    if getattr(sys.excepthook, "_treadle", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if (
            isinstance(error, APIError)
            and error.hint is not None
            and os.environ.get("TREADLE_TRACEBACK", "") in ("", "0")
        ):
            print(f"{kind.__name__}: {error}{_where(tb)}", file=sys.stderr)
            return
        previous(kind, error, tb)

    hook._treadle = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _where(tb: TracebackType | None) -> str:
    """` (at script.py:12)`: the caller's line that called into this package."""
    caller = None
    for frame in traceback.extract_tb(tb):
        if frame.filename.startswith(_PACKAGE):
            break
        caller = frame
    return "" if caller is None else f" (at {Path(caller.filename).name}:{caller.lineno})"
