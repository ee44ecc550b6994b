"""Outcome listeners: what hears of every op filed and finished, off the path of its result.

`Futures` (treadle.server.core.futures) tells each listener the app gave it:
- `filed(op, values)` on the event loop as an op is filed, before its request row is
  committed and before its op can run (`values`: the row's columns: tenant_id, key_id,
  base_model, session_id, model_id, ...);
- `forget(request_id)` when that filing was never committed (nothing will finish);
- `finished(outcomes)` on the journal thread, in commit order, once the outcomes are
  committed and their polls woken: a listener never holds up a result, and must not block.

Two listeners exist: spend counting (treadle.server.tenancy.spend_listener, always) and the
console's recorder (treadle.server.console.recorder, when the console is on). A listener that
raises is logged and skipped: it never fails a request, nor keeps another listener from
hearing of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from treadle.protocol.ops import Op, Outcome

log = logging.getLogger("treadle.listeners")


class OutcomeListener(Protocol):
    def filed(self, op: Op, values: Mapping[str, Any]) -> None: ...

    def forget(self, request_id: str) -> None: ...

    def finished(self, outcomes: list[Outcome]) -> None: ...


def tell(listeners: list[OutcomeListener], hear: Callable[[OutcomeListener], None]) -> None:
    """Call `hear` on each listener; one that raises is logged, and the others still hear."""
    for listener in listeners:
        try:
            hear(listener)
        except Exception:
            log.exception("outcome listener %s failed", type(listener).__name__)
