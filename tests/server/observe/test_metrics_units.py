"""Units of the metrics: the route label is the path template (never the raw path), tenant
labels are a bounded set, the outcome listener observes queue wait and latency from the
engine's stamps, a lost worker's cause, and the trace context on the op message (absent
when tracing is off)."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from treadle.engine.types import AdamSpec, TrainResult
from treadle.protocol import messages
from treadle.protocol.ops import Op, OpKind, OptimStep, Outcome, Usage
from treadle.server.observe.http import ObserveRequests
from treadle.server.observe.listener import MetricsListener, TenantLabels
from treadle.server.observe.metrics import fault_cause


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_requests_are_labelled_by_their_route_template():
    async def item(request):
        return PlainTextResponse(request.path_params["item_id"])

    app = Starlette(routes=[Route("/items/{item_id}", item)])
    app.add_middleware(ObserveRequests)
    series = ("treadle_http_requests_total",)
    before = sample(*series, route="/items/{item_id}", method="GET", status="200")
    unmatched = sample(*series, route="unmatched", method="GET", status="404")
    with TestClient(app) as client:
        for i in range(3):
            assert client.get(f"/items/{i}-secret").status_code == 200
        assert client.get("/nowhere/else").status_code == 404
    assert sample(*series, route="/items/{item_id}", method="GET", status="200") == before + 3
    assert sample(*series, route="unmatched", method="GET", status="404") == unmatched + 1
    assert sample(*series, route="/items/0-secret", method="GET", status="200") == 0


def test_tenant_labels_are_a_bounded_set():
    labels = TenantLabels(limit=2)
    assert [labels.of(t, n) for t, n in (("t1", "alice"), ("t2", "bob"), ("t3", "carol"))] == [
        "alice",
        "bob",
        "other",
    ]
    assert labels.of("t1", "alice") == "alice" and labels.of("t4", "dave") == "other"


def test_the_listener_observes_queue_wait_and_latency_from_the_engine_stamps():
    listener = MetricsListener(max_tenants=10)
    op = Op("r1", OpKind.OPTIM_STEP, OptimStep(AdamSpec(learning_rate=1e-3)), "m", 1)
    count = sample("treadle_op_queue_seconds_count", kind="optim_step")
    queued = sample("treadle_op_queue_seconds_sum", kind="optim_step")
    ran = sample("treadle_op_latency_seconds_sum", kind="optim_step")
    listener.filed(op, {"tenant_id": "default"})
    filed_at = time.time()
    done = Outcome("r1", result=None, started_at=filed_at + 2.0, finished_at=filed_at + 5.0)
    listener.finished([done])
    assert sample("treadle_op_queue_seconds_count", kind="optim_step") == count + 1
    assert sample("treadle_op_queue_seconds_sum", kind="optim_step") - queued == pytest.approx(
        2.0, abs=0.05
    )
    assert sample("treadle_op_latency_seconds_sum", kind="optim_step") - ran == pytest.approx(
        5.0, abs=0.05
    )
    listener.finished([done])  # heard twice: observed once
    assert sample("treadle_op_queue_seconds_count", kind="optim_step") == count + 1
    assert len(listener) == 0


def test_train_tokens_are_counted_under_the_tenants_label():
    listener = MetricsListener(max_tenants=10)
    op = Op("r2", OpKind.OPTIM_STEP, OptimStep(AdamSpec(learning_rate=1e-3)), "m", 2)
    before = sample("treadle_tokens_total", kind="train", tenant="default")
    listener.filed(op, {"tenant_id": "default"})
    listener.finished([Outcome("r2", result=TrainResult([], {}), usage=Usage(train_tokens=7))])
    assert sample("treadle_tokens_total", kind="train", tenant="default") == before + 7


@pytest.mark.parametrize(
    "reason, cause",
    [
        ("worker process 12 crashed (SIGSEGV) running 1 ops", "crash"),
        ("worker process 12 was killed by the kernel's OOM killer (out of memory)", "oom"),
        ("no heartbeat for 3.0 s", "heartbeat"),
        ("worker process 12 exited with code -9", "exit"),
        ("worker process 12 exited with code 0", "clean"),
        ("replaced by a new worker", "replaced"),
    ],
)
def test_a_lost_workers_cause(reason, cause):
    assert fault_cause(reason) == cause


def test_the_op_message_carries_the_trace_context_only_when_given():
    op = Op("r3", OpKind.OPTIM_STEP, OptimStep(AdamSpec(learning_rate=1e-3)), "m", 3)
    assert messages.decode_op(messages.encode_op(op)).trace is None  # tracing off
    op.trace = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    assert messages.decode_op(messages.encode_op(op)).trace == op.trace
