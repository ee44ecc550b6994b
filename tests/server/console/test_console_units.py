"""The console's parts without HTTP or an engine: per-step figures and op records written
by its recorder where outcomes finish (a real database and journal, fake ops), the loop's
own figures, and the timeline's percentiles, lanes and Chrome trace.

    .venv/bin/python -m pytest -q tests/server/console/test_console_units.py
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from sqlalchemy import select

from treadle.engine.types import AdamSpec, SampledSeq, SampleRequest, SampleResult, TrainDatum
from treadle.engine.types import TrainResult as EngineTrainResult
from treadle.protocol.facts import EngineFacts
from treadle.protocol.ops import (
    Op,
    OpKind,
    OptimResult,
    OptimStep,
    Outcome,
    Sample,
    TrainData,
    Usage,
)
from treadle.server.config import InputLimits, Price
from treadle.server.console import timeline
from treadle.server.console.figures import check_user_metrics, log_user
from treadle.server.console.recorder import Recorder
from treadle.server.core.board import FutureBoard
from treadle.server.core.futures import Futures
from treadle.server.core.limits import Admission
from treadle.server.storage.database import Store
from treadle.server.storage.journal import Journal
from treadle.server.storage.rows import OpRecordRow, StepFigureRow
from treadle.server.tenancy import spend
from treadle.server.tenancy.auth import DEV_TENANT, Tenant
from treadle.server.tenancy.quotas import QuotaBook, Quotas
from treadle.server.tenancy.spend_listener import SpendListener

PRICE = {"m": Price(prefill=1.0, sample=2.0, train=4.0)}  # $ per million tokens


class Engine:
    """Records queued ops; the test finishes them by hand."""

    facts = EngineFacts("m", vocab_size=10, max_seq_len=64, max_lora_rank=8)
    name = "m"

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def submit(self, op: Op) -> None:
        self.ops.append(op)


def datum(n: int, weighted: int) -> TrainDatum:
    w = np.zeros(n, np.float32)
    w[:weighted] = 1.0
    return TrainDatum(np.arange(n), {"target_tokens": np.arange(n), "weights": w})


def run(tmp_path, scenario) -> None:
    """`scenario(store, futures, recorder, book, engine)` against a real database and
    journal, with the listeners the app gives Futures when the console is on."""

    async def main() -> None:
        store = Store(f"sqlite:///{tmp_path / 'treadle.db'}")
        journal = Journal(store.engine)
        journal.start()
        book = spend.SpendBook(store.engine, PRICE)
        admission = Admission(InputLimits(), QuotaBook(Quotas(), {}), spend=book)
        recorder = Recorder(journal)
        board = FutureBoard(asyncio.get_running_loop())
        futures = Futures(journal, board, admission, 30.0, [SpendListener(book), recorder])
        try:
            await scenario(store, futures, recorder, book, Engine())
        finally:
            journal.stop()
            store.close()

    asyncio.run(main())


async def settle(futures: Futures, recorder: Recorder, request_id: str) -> None:
    await futures.result(request_id)  # its outcome committed and delivered
    await futures.journal.run(lambda conn: None)  # its figures recorded (after the commit)
    await asyncio.to_thread(recorder.flush)  # and written


def test_steps_and_figures_are_recorded_where_outcomes_finish(tmp_path):
    async def scenario(store, futures, recorder, book, engine):
        kw = {"tenant": DEV_TENANT, "session_id": "s", "model_id": "s:train:0"}
        model = "s:train:0"
        seq = iter(range(1, 100))

        async def fb(loss: float, data: list[TrainDatum]) -> None:
            payload = TrainData(data, "cross_entropy", {})
            rid = await futures.file(
                engine, OpKind.FORWARD_BACKWARD, payload, seq_id=next(seq), **kw
            )
            outcome = Outcome.ok(
                rid, EngineTrainResult([], {"loss:sum": loss}), Usage(train_tokens=payload.n_tokens)
            )
            futures.finish([outcome.timed(time.time())])
            await settle(futures, recorder, rid)

        async def optim(grad_norm: float, lr: float) -> None:
            rid = await futures.file(
                engine, OpKind.OPTIM_STEP, OptimStep(AdamSpec()), seq_id=next(seq), **kw
            )
            result = OptimResult({"grad_norm:mean": grad_norm, "learning_rate:mean": lr})
            futures.finish([Outcome.ok(rid, result).timed(time.time())])
            await settle(futures, recorder, rid)

        # step 0: two forward_backward chunks (loss per loss token over both), then a step
        await fb(6.0, [datum(8, 3), datum(4, 4)])
        await fb(2.0, [datum(5, 1)])
        await optim(1.5, 1e-3)
        await fb(3.0, [datum(6, 6)])  # step 1
        await optim(0.5, 5e-4)
        journal = futures.journal  # the loop's own (log_metrics), console or not
        await log_user(journal, "default", "s", model, 1, {"train/reward": 0.25})
        await log_user(journal, "default", "s", model, 1, {"train/reward": 0.5})  # replaces

        rows = store.query(select(StepFigureRow).order_by(StepFigureRow.step, StepFigureRow.name))
        got = {(r.step, r.name, r.source): r.value for r in rows}
        assert got[(0, "server/loss_sum", "server")] == 8.0
        assert got[(0, "server/loss_tokens", "server")] == 8  # 3 + 4 + 1 weighted targets
        assert got[(0, "server/loss", "server")] == 1.0
        assert got[(0, "server/tokens", "server")] == 17
        assert got[(0, "server/grad_norm", "server")] == 1.5
        assert got[(0, "server/learning_rate", "server")] == 1e-3
        assert got[(1, "server/loss", "server")] == 0.5
        assert got[(1, "server/grad_norm", "server")] == 0.5
        assert got[(1, "train/reward", "user")] == 0.5
        assert len(rows) == len(got)  # one row per (step, name, source)

        ops = store.query(select(OpRecordRow).order_by(OpRecordRow.queued_at))
        assert [o.kind for o in ops] == ["forward_backward"] * 2 + [
            "optim_step",
            "forward_backward",
            "optim_step",
        ]
        assert [o.step for o in ops] == [0, 0, 0, 1, 1]
        for o in ops:
            assert o.status == "done" and o.tenant_id == "default" and o.session_id == "s"
            assert o.queued_at <= o.started_at <= o.finished_at
        assert ops[0].train_tokens == 12
        # the spend counters saw every metered token: 12 + 5 + 6 train tokens at $4/M
        today = book.spent("default", spend.TENANT_SCOPE, "day")
        assert today.tokens == 23 and today.usd == pytest.approx(23 * 4e-6)

    run(tmp_path, scenario)


def test_a_failed_op_is_recorded_and_opens_no_step(tmp_path):
    async def scenario(store, futures, recorder, book, engine):
        kw = {"tenant": DEV_TENANT, "session_id": "s", "model_id": "s:train:0"}
        rid = await futures.file(engine, OpKind.OPTIM_STEP, OptimStep(AdamSpec()), seq_id=1, **kw)
        futures.finish([Outcome.failed(rid, ValueError("boom")).timed(time.time())])
        with pytest.raises(Exception, match="boom"):
            await futures.result(rid)
        await futures.journal.run(lambda conn: None)
        await asyncio.to_thread(recorder.flush)
        (op,) = store.query(select(OpRecordRow))
        assert op.status == "failed" and "boom" in op.error and op.step == 0
        assert store.query(select(StepFigureRow)) == []

    run(tmp_path, scenario)


def test_batch_sizes_and_in_flight_are_per_tenant(tmp_path):
    async def scenario(store, futures, recorder, book, engine):
        other = Tenant("t2", "other")
        rids = []
        for tenant, n in ((DEV_TENANT, 2), (other, 3)):
            req = SampleRequest([1, 2], num_samples=n)
            kw = {"tenant": tenant, "session_id": tenant.name, "sampling_session_id": "x"}
            rids.append(await futures.file(engine, OpKind.SAMPLE, Sample(req), **kw))
        assert recorder.in_flight("m", None) == 2 and recorder.in_flight("m", "t2") == 1
        started = time.time()  # one engine call ran both
        result = SampleResult([SampledSeq([1], [0.0], "length")])
        futures.finish([Outcome.ok(r, result).timed(started) for r in rids])
        for r in rids:
            await settle(futures, recorder, r)
        assert recorder.in_flight("m", None) == 0
        both = recorder.batch_sizes("m", None)["sample"]
        assert (both["calls"], both["max_ops"], both["max_rows"]) == (1, 2, 5)
        mine = recorder.batch_sizes("m", "t2")["sample"]
        assert (mine["calls"], mine["max_ops"], mine["max_rows"]) == (1, 1, 3)
        assert {o.batch_ops for o in store.query(select(OpRecordRow))} == {2}

    run(tmp_path, scenario)


def test_user_metrics_are_checked():
    assert check_user_metrics(3, {"a": 1, "b": float("nan")}) == (3, {"a": 1.0}, ["b"])
    for step, metrics, field in [
        (-1, {"a": 1}, "step"),
        (1.5, {"a": 1}, "step"),
        (True, {"a": 1}, "step"),
        (1, {}, "metrics"),
        (1, {"a": "x"}, "metrics.a"),
        (1, {"server/loss": 1.0}, "server/"),
        (1, {"x" * 200: 1.0}, "names"),
    ]:
        with pytest.raises(ValueError, match=field):
            check_user_metrics(step, metrics)


# ---- timeline ----
def _op(kind, queued, started, finished, model="s:train:0", status="done"):
    return {
        "request_id": f"r{queued}",
        "kind": kind,
        "model_id": model,
        "status": status,
        "queued_at": queued,
        "started_at": started,
        "finished_at": finished,
        "step": 0,
        "batch_ops": 1,
        "prompt_tokens": 0,
        "sampled_tokens": 0,
        "train_tokens": 4,
    }


def test_percentiles_are_nearest_rank_per_kind():
    assert timeline.percentile([], 50) == 0.0
    values = list(range(1, 101))
    assert [timeline.percentile(values, q) for q in (50, 90, 99)] == [50, 90, 99]
    ops = [_op("forward_backward", 0.0, 0.010 * i, 0.010 * i + 0.002) for i in range(1, 11)]
    ops.append(_op("sample", 0.0, None, 0.5, status="failed"))  # never ran
    summary = timeline.summarize(ops)
    fb = summary["forward_backward"]
    assert fb["count"] == 10 and fb["failed"] == 0
    assert fb["wait_ms"]["p50"] == pytest.approx(50.0) and fb["wait_ms"]["p99"] == pytest.approx(
        100.0
    )
    assert fb["run_ms"]["p90"] == pytest.approx(2.0)
    assert summary["sample"]["failed"] == 1 and summary["sample"]["wait_ms"]["p50"] == 500.0


def test_lanes_never_overlap_and_the_trace_nests_runs_in_ops():
    rng = np.random.default_rng(0)
    ops = []
    for i in range(60):
        q = float(rng.uniform(0, 10))
        s = q + float(rng.uniform(0, 1))
        kind = "sample" if i % 3 else "forward_backward"
        ops.append(_op(kind, q, s, s + float(rng.uniform(0.01, 1))))
    lanes = timeline.assign_lanes(ops)
    for key in set(lanes):
        spans = sorted(
            (op["queued_at"], op["finished_at"])
            for op, k in zip(ops, lanes, strict=True)
            if k == key
        )
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    trace = timeline.chrome_trace(ops, "t")
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    parents = {(e["tid"], e["args"].get("request_id")): e for e in events if e["cat"] == "op"}
    assert len(parents) == len(ops) and sum(e["cat"] == "run" for e in events) == len(ops)
    by_tid: dict[int, list] = {}
    for e in events:
        by_tid.setdefault(e["tid"], []).append(e)
    for evs in by_tid.values():  # runs lie within an op of their lane
        ops_here = [e for e in evs if e["cat"] == "op"]
        for run in (e for e in evs if e["cat"] == "run"):
            assert any(
                p["ts"] <= run["ts"] + 0.2 and run["ts"] + run["dur"] <= p["ts"] + p["dur"] + 0.2
                for p in ops_here
            )
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert len(names) == len(set(lanes))
    bars = timeline.svg_bars(ops)
    assert len(bars["bars"]) == len(ops) and bars["height"] <= 480
    assert all(0 <= b["x0"] <= b["x1"] <= b["x2"] <= bars["width"] + 0.5 for b in bars["bars"])
