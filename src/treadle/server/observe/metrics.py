"""The API process's Prometheus metrics (GET /metrics), through the official client library.

Counters and histograms live in the client's default registry, one set per process (one
API process per deployment); whoever knows of an event counts it where it happens:

| metric | labels | counted by |
|---|---|---|
| treadle_http_requests_total, treadle_http_request_seconds | route (its path template), method, status | the ASGI middleware (treadle.server.observe.http) |
| treadle_ops_total, treadle_op_latency_seconds, treadle_op_queue_seconds | kind (, status) | the outcome listener (treadle.server.observe.listener) |
| treadle_tokens_total | kind (prefill, sample, train), tenant (a bounded set) | the outcome listener |
| treadle_engine_calls_total, treadle_decode_steps_total, treadle_decode_rows_total | model (, kind) | workers' heartbeats (treadle.server.engines.remote) |
| treadle_sampler_events_total | model, event | the same, with --sampler vllm (treadle.worker.vllm) |
| treadle_worker_restarts_total, treadle_engine_faults_total | model (, cause) | the worker's handle (remote) |
| treadle_snapshot_seconds, treadle_restore_seconds | model | the worker's handle (remote) |
| treadle_db_commit_seconds | | the journal (treadle.server.storage.journal) |

and, read from the server's state at each scrape (`Live`): treadle_queue_depth,
treadle_running_ops and treadle_decode_batch per served model, treadle_sessions_live,
treadle_samplers_live. No label ever holds a session, model or request id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("treadle.metrics")
disable_created_metrics()  # no *_created series: half the scrape, nothing alerted on

# seconds: from a cached poll (sub-millisecond) to a long sample or a big save
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
COMMIT_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip

HTTP_REQUESTS = Counter(
    "treadle_http_requests", "HTTP requests answered", ["route", "method", "status"]
)
HTTP_SECONDS = Histogram(
    "treadle_http_request_seconds",
    "Time to answer an HTTP request (a long poll counts its wait)",
    ["route", "method"],
    buckets=LATENCY_BUCKETS,
)
OPS = Counter("treadle_ops", "Ops finished (futures resolved)", ["kind", "status"])
OP_LATENCY = Histogram(
    "treadle_op_latency_seconds",
    "From an op's filing to its end in the engine",
    ["kind"],
    buckets=LATENCY_BUCKETS,
)
OP_QUEUE = Histogram(
    "treadle_op_queue_seconds",
    "From an op's filing to the start of the engine call it ran in",
    ["kind"],
    buckets=LATENCY_BUCKETS,
)
TOKENS = Counter(
    "treadle_tokens", "Metered tokens of successful ops", ["kind", "tenant"]
)  # kind: prefill | sample | train
ENGINE_CALLS = Counter(
    "treadle_engine_calls", "Engine calls of the workers (train, sample, single)", ["model", "kind"]
)
DECODE_STEPS = Counter("treadle_decode_steps", "Decode steps of the sampler", ["model"])
DECODE_ROWS = Counter(
    "treadle_decode_rows",
    "Sample ops in the decode batch, summed over decode steps (÷ steps: the mean batch)",
    ["model"],
)
SAMPLER_EVENTS = Counter(
    "treadle_sampler_events",
    "With --sampler vllm: vllm_samples (requests vLLM took), fell_back (given back to "
    "Treadle's sampler), parity_checks, parity_trips, vllm_deaths, vllm_cached_prompt_tokens",
    ["model", "event"],
)
WORKER_RESTARTS = Counter(
    "treadle_worker_restarts", "Workers that took over a model after the first", ["model"]
)
ENGINE_FAULTS = Counter(
    "treadle_engine_faults",
    "Workers lost, by cause (engine_fault, crash, oom, exit, heartbeat, replaced)",
    ["model", "cause"],
)
SNAPSHOT_SECONDS = Histogram(
    "treadle_snapshot_seconds",
    "Time a worker took to write a model's state snapshot",
    ["model"],
    buckets=LATENCY_BUCKETS,
)
RESTORE_SECONDS = Histogram(
    "treadle_restore_seconds",
    "Time to restore a worker's models (snapshots and op log) after it said hello",
    ["model"],
    buckets=LATENCY_BUCKETS,
)
DB_COMMIT_SECONDS = Histogram(
    "treadle_db_commit_seconds",
    "Time of one journal transaction (a batch of request rows and results)",
    buckets=COMMIT_BUCKETS,
)


_CHILDREN: dict[tuple[int, tuple[str, ...]], Any] = {}


def child(metric: Any, *labels: str) -> Any:
    """`metric.labels(*labels)`, cached: the hot path (a request, an op) skips the client's
    label checks and lock after the first time (a race makes the same child twice: harmless)."""
    key = (id(metric), labels)
    found = _CHILDREN.get(key)
    if found is None:
        found = _CHILDREN[key] = metric.labels(*labels)
    return found


def fault_cause(reason: str) -> str:
    """The cause label of a lost worker, from the reason its handle was given."""
    text = reason.lower()
    for needle, cause in (
        ("with code 0", "clean"),  # a worker that ended as asked: no fault
        ("oom", "oom"),
        ("crashed", "crash"),
        ("heartbeat", "heartbeat"),
        ("replaced", "replaced"),
        ("exited", "exit"),
    ):
        if needle in text:
            return cause
    return "other"


@dataclass(frozen=True)
class ModelLive:
    """What one served model's workers are doing now (summed over its replicas)."""

    model: str
    queue_depth: int
    running: int
    decode_batch: int


@dataclass(frozen=True)
class LiveFigures:
    models: list[ModelLive]
    sessions: int
    samplers: int


class Live(Collector):
    """Gauges read from the running server at each scrape (`read`, set by the app)."""

    def __init__(self) -> None:
        self.read: Callable[[], LiveFigures] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        read = self.read
        if read is None:
            return
        try:
            figures = read()
        except Exception:  # a scrape must not fail because one figure could not be read
            log.warning("could not read the live figures", exc_info=True)
            return
        gauges = {
            "queue_depth": GaugeMetricFamily(
                "treadle_queue_depth",
                "Ops handed to a model's workers, not finished",
                labels=["model"],
            ),
            "running": GaugeMetricFamily(
                "treadle_running_ops", "Ops in a model's engines now", labels=["model"]
            ),
            "decode_batch": GaugeMetricFamily(
                "treadle_decode_batch",
                "Sample ops in a model's decode batches now",
                labels=["model"],
            ),
        }
        for m in figures.models:
            for name, gauge in gauges.items():
                gauge.add_metric([m.model], getattr(m, name))
        yield from gauges.values()
        yield GaugeMetricFamily("treadle_sessions_live", "Active sessions", figures.sessions)
        yield GaugeMetricFamily(
            "treadle_samplers_live", "Sampling sessions of active sessions", figures.samplers
        )


LIVE = Live()
REGISTRY.register(LIVE)
