"""What observing costs per call: the Prometheus middleware on one HTTP request, and the
metrics' outcome listener on one op, against the same without them.

    .venv/bin/python bench/observe_cost.py                 # 20,000 requests and ops per side
    .venv/bin/python bench/observe_cost.py --n 5000

Requests go straight into the ASGI app (no socket: the cost of the middleware alone is what
is left over), a route with a path parameter behind the app's own middleware stack, with and
without ObserveRequests, in alternating blocks; medians of the blocks compared. The listener:
`filed` then `finished` of one op with its outcome stamped, against two calls of a listener
that does nothing. For scale, bench/service.py's minimal call takes about 20 ms.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from treadle.engine.types import AdamSpec
from treadle.protocol.ops import Op, OpKind, OptimStep, Outcome, Usage
from treadle.server.observe.http import ObserveRequests
from treadle.server.observe.listener import MetricsListener


def make_app(observed: bool) -> Starlette:
    async def item(request):
        return PlainTextResponse(request.path_params["item_id"])

    app = Starlette(routes=[Route("/api/v1/items/{item_id}", item)])
    if observed:
        app.add_middleware(ObserveRequests)
    return app


async def requests_s(app, n: int) -> float:
    """Seconds per request through the ASGI app."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/api/v1/items/42",
        "raw_path": b"/api/v1/items/42",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"bench")],
        "client": ("127.0.0.1", 1),
        "server": ("bench", 80),
    }

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    t0 = time.perf_counter()
    for _ in range(n):
        await app(dict(scope), receive, send)
    return (time.perf_counter() - t0) / n


class Nothing:
    def filed(self, op, values):
        pass

    def finished(self, outcomes):
        pass


def ops_s(listener, n: int) -> float:
    """Seconds per op heard (filed, then finished)."""
    adam = OptimStep(AdamSpec())
    ops = [Op(f"r{i}", OpKind.OPTIM_STEP, adam, "m", i) for i in range(n)]
    now = time.time()
    outs = [
        Outcome(op.request_id, usage=Usage(train_tokens=8), started_at=now, finished_at=now)
        for op in ops
    ]
    values = {"tenant_id": "default"}
    t0 = time.perf_counter()
    for op, out in zip(ops, outs, strict=True):
        listener.filed(op, values)
        listener.finished([out])
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000, help="requests and ops per side")
    ap.add_argument("--blocks", type=int, default=10)
    args = ap.parse_args()
    per_block = max(1, args.n // args.blocks)
    plain, observed = make_app(False), make_app(True)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(requests_s(observed, 200))  # warm-up: imports, first labels
    http = {"plain": [], "observed": []}
    for _ in range(args.blocks):
        http["plain"].append(loop.run_until_complete(requests_s(plain, per_block)))
        http["observed"].append(loop.run_until_complete(requests_s(observed, per_block)))
    listener, nothing = MetricsListener(50), Nothing()
    ops_s(listener, 200)
    op = {"nothing": [], "metrics": []}
    for _ in range(args.blocks):
        op["nothing"].append(ops_s(nothing, per_block))
        op["metrics"].append(ops_s(listener, per_block))
    med = {k: statistics.median(v) * 1e6 for k, v in {**http, **op}.items()}
    request_us = med["observed"] - med["plain"]
    op_us = med["metrics"] - med["nothing"]
    print(f"a request through the app: {med['plain']:.1f} us, observed {med['observed']:.1f} us")
    print(f"  the middleware adds {request_us:.1f} us per request")
    print(f"an op heard by the metrics listener: {op_us:.1f} us (filed + finished)")
    print(
        json.dumps(
            {
                "bench": "observe_cost",
                "request_plain_us": round(med["plain"], 2),
                "request_observed_us": round(med["observed"], 2),
                "middleware_us_per_request": round(request_us, 2),
                "observed_over_plain": round(med["observed"] / med["plain"], 3),
                "listener_us_per_op": round(op_us, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
