"""The worker's spans: one per traced op of an engine call, a child of the span of the HTTP
request that filed the op (Op.trace), from the call's start to its end, with a link to each
other traced request of the same call. Nothing runs when tracing is off (no tracer, or no
op of the call carries a trace)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from treadle.protocol import tracing
from treadle.protocol.ops import Op


def trace_call(
    name: str,
    ops: Sequence[Op],
    started: float,
    finished: float,
    ends: Mapping[str, float | None] | None = None,
) -> None:
    """Spans of one engine call (`started`/`finished`: wall-clock seconds) for its traced ops;
    `ends`: an op's own end where its outcome was stamped with one (Outcome.finished_at)."""
    tracer = tracing.tracer()
    if tracer is None:
        return
    traced = [(op, ctx) for op in ops if (ctx := tracing.span_context(op.trace)) is not None]
    if not traced:
        return
    from opentelemetry.trace import Link, SpanKind

    start_ns = int(started * 1e9)
    for op, _ in traced:
        end = (ends or {}).get(op.request_id) or finished
        links = [Link(other) for o, other in traced if o is not op]
        span = tracer.start_span(
            f"engine {name}",
            context=tracing.parent_of(op.trace),
            kind=SpanKind.INTERNAL,
            links=links,
            start_time=start_ns,
            attributes={
                "treadle.op.kind": str(op.kind),
                "treadle.request_id": op.request_id,
                "treadle.call.ops": len(ops),
            },
        )
        span.end(end_time=int(end * 1e9))
