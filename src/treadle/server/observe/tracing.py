"""A trace per request, on the API's side (made only when tracing is on: ServerConfig
otel_endpoint or OTEL_EXPORTER_OTLP_ENDPOINT, and the OpenTelemetry SDK installed).

The spans of one op, all children of the span of the HTTP request that filed it (made by
treadle.server.observe.http):

    POST /api/v1/forward_backward            the HTTP request (server span)
    ├── file forward_backward                checks, its request row written and committed
    ├── queued                               from that commit to the start of its engine call
    ├── engine train                         the engine call (made by the worker, links to the
    │                                        other requests of the same call)
    └── record result                        from the call's end until its result is committed

The request's traceparent rides on the op (Op.trace) to the worker (treadle.protocol.tracing).
`filing` is called by Futures as it files an op; the rest is an outcome listener
(treadle.server.core.listeners): `finished` runs once the result is committed.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from treadle.protocol import tracing
from treadle.protocol.ops import Op, Outcome

MAX_PENDING = 100_000


@dataclass
class _Filed:
    parent: Any  # the Context of the request's span
    committed_ns: int | None = None  # wall-clock nanoseconds


class RequestTracing:
    def __init__(self, tracer: Any):
        self.tracer = tracer
        self._lock = threading.Lock()
        self._filed: OrderedDict[str, _Filed] = OrderedDict()

    def filing(self, op: Op) -> Callable[[Any], None] | None:
        """The event loop, in the request's context, before its row is written: the op
        carries the request's span to the worker; → what ends the filing's span (called
        once the row is committed), or None outside a traced request."""
        from opentelemetry import context, trace

        current = trace.get_current_span()
        if not current.get_span_context().is_valid:
            return None
        op.trace = tracing.traceparent(current)
        note = _Filed(context.get_current())
        with self._lock:
            self._filed[op.request_id] = note
            if len(self._filed) > MAX_PENDING:
                self._filed.popitem(last=False)
        span = self.tracer.start_span(
            f"file {op.kind}", attributes={"treadle.op.kind": str(op.kind)}
        )

        def committed(_: Any) -> None:
            note.committed_ns = time.time_ns()
            span.end(end_time=note.committed_ns)

        return committed

    # ---- the outcome listener ----
    def filed(self, op: Op, values: Mapping[str, Any]) -> None:
        pass  # noted by `filing`, which also hands the op its traceparent

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._filed.pop(request_id, None)

    def finished(self, outcomes: list[Outcome]) -> None:
        now = time.time_ns()
        with self._lock:
            notes = [(o, n) for o in outcomes if (n := self._filed.pop(o.request_id, None))]
        for o, n in notes:
            committed = n.committed_ns
            if committed is not None and o.started_at is not None:
                self._span("queued", n.parent, committed, max(committed, _ns(o.started_at)))
            end = _ns(o.finished_at) if o.finished_at is not None else committed
            if end is not None:
                attributes = {"treadle.op.status": "done" if o.succeeded else "failed"}
                self._span("record result", n.parent, end, max(end, now), attributes)

    def _span(
        self, name: str, parent: Any, start_ns: int, end_ns: int, attributes: dict | None = None
    ) -> None:
        span = self.tracer.start_span(
            name, context=parent, start_time=start_ns, attributes=attributes
        )
        span.end(end_time=end_ns)


def _ns(seconds: float) -> int:
    """Wall-clock seconds (as the engine stamps them) in nanoseconds, as the worker's spans
    convert them (treadle.worker.call_spans): the same float gives the same instant."""
    return int(seconds * 1e9)
