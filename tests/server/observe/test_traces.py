"""OpenTelemetry traces of a real `treadle serve` (API and worker processes) exported over
OTLP/HTTP to a receiver in this test (a plain HTTP server that decodes the protobuf export
with the opentelemetry-proto package): each forward_backward is a trace whose HTTP request
span (the API process) has its filing, its time queued, the engine call it ran in (made by
the worker process, with links to the other requests of that call) and its result's commit
as children, in order.

Skips, saying why, without the OpenTelemetry SDK and exporter (pip install 'treadle[otel]').

    .venv/bin/python -m pytest -q tests/server/observe/test_traces.py
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from treadle import Datum, ModelInput, ServiceClient, TensorData
from treadle.launch import ServerProcess

pytest.importorskip("opentelemetry.sdk", reason="needs treadle[otel] (opentelemetry-sdk)")
pytest.importorskip(
    "opentelemetry.exporter.otlp.proto.http", reason="needs treadle[otel] (the OTLP exporter)"
)
trace_service = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="needs opentelemetry-proto",
)

TINY = "treadle/tiny-llama"
WAIT_S = 120.0
HTTP_FB = "POST /api/v1/forward_backward"


class Receiver:
    """An OTLP/HTTP trace receiver: every span it is sent, with its service's name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service.ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver.lock:
                    for rs in request.resource_spans:
                        service = next(
                            a.value.string_value
                            for a in rs.resource.attributes
                            if a.key == "service.name"
                        )
                        for ss in rs.scope_spans:
                            receiver.spans.extend((service, s) for s in ss.spans)
                reply = trace_service.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def trace(self, trace_id: bytes) -> list[tuple[str, object]]:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id == trace_id]

    def http_spans(self, name: str) -> list[object]:
        with self.lock:
            return [s for _, s in self.spans if s.name == name]


def batch(rng: np.random.Generator, rows: int, n: int) -> list[Datum]:
    out = []
    for _ in range(rows):
        seq = rng.integers(0, 200, n + 1)
        out.append(
            Datum(
                model_input=ModelInput.from_ints(seq[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": TensorData.from_numpy(seq[1:].astype(np.int64)),
                    "weights": TensorData.from_numpy(np.ones(n, np.float32)),
                },
            )
        )
    return out


@pytest.fixture
def traced_server(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 0.1 s (both processes)
    receiver = Receiver()
    server = ServerProcess(
        {TINY: tiny_model_dir},
        tmp_path / "data",
        config={"otel_endpoint": receiver.url},
        startup_timeout_s=180,
    ).start()
    yield server, receiver
    server.stop()
    receiver.http.shutdown()


def wait_until(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"no {what} after {WAIT_S} s")


def test_a_forward_backward_is_one_trace_across_both_processes(traced_server):
    server, receiver = traced_server
    rng = np.random.default_rng(0)
    svc = ServiceClient(base_url=server.url)
    try:
        a, b, c = (svc.create_lora_training_client(TINY, rank=4) for _ in range(3))
        # a's long call runs while b's and c's are filed: those two share the next call
        slow = a.forward_backward(batch(rng, 8, 96), "cross_entropy")
        fbs = [t.forward_backward(batch(rng, 2, 16), "cross_entropy") for t in (b, c)]
        for f in (slow, *fbs):
            f.result(timeout=WAIT_S)
    finally:
        svc.close()

    def traced() -> list[list[tuple[str, object]]]:
        """The traces of the 3 forward_backward requests, once each has its 5 spans."""
        roots = receiver.http_spans(HTTP_FB)
        traces = [receiver.trace(r.trace_id) for r in roots]
        return traces if len(roots) == 3 and all(len(t) >= 5 for t in traces) else []

    wait_until(traced, "3 forward_backward traces of 5 spans")
    calls: dict[int, list[tuple[object, object]]] = {}  # engine call start → (http, call)
    for trace in traced():
        spans = {s.name: (svc_, s) for svc_, s in trace}
        assert len(spans) == len(trace) == 5, sorted(spans)
        svc_http, http = spans[HTTP_FB]
        assert svc_http == "treadle-api" and http.parent_span_id == b""  # the trace's root
        assert http.kind == 2  # SPAN_KIND_SERVER
        children = {name: s for name, (_, s) in spans.items() if s.parent_span_id == http.span_id}
        assert set(children) == {"file forward_backward", "queued", "engine train", "record result"}
        assert spans["engine train"][0] == "treadle-worker"  # made across the process boundary
        # in order: filed, then queued until the call began, the call, then the commit
        file, queued, call, record = (
            children[n]
            for n in ("file forward_backward", "queued", "engine train", "record result")
        )
        assert file.start_time_unix_nano <= file.end_time_unix_nano <= queued.start_time_unix_nano
        assert queued.end_time_unix_nano == call.start_time_unix_nano
        assert call.end_time_unix_nano == record.start_time_unix_nano
        assert record.end_time_unix_nano >= record.start_time_unix_nano
        calls.setdefault(call.start_time_unix_nano, []).append((http, call))
    # links: from each request's engine span to the HTTP spans of the other requests of the
    # same engine call (b's and c's at least share one: they were filed while a's ran)
    assert max(len(members) for members in calls.values()) >= 2
    for members in calls.values():
        for http, call in members:
            assert _attr(call, "treadle.call.ops") == len(members)
            others = {(h.trace_id, h.span_id) for h, _ in members if h is not http}
            assert {(link.trace_id, link.span_id) for link in call.links} == others


def _attr(span, key: str):
    for a in span.attributes:
        if a.key == key:
            v = a.value
            return v.int_value if v.HasField("int_value") else v.string_value
    return None
