"""Futures.file, poll and result against a real database and journal, without HTTP or an
engine: resubmissions are recognised even once memory has let their keys go, a result
reaches its poll from memory while the database keeps the record, and in-process callers
get typed results or the error raised as its own class."""

from __future__ import annotations

import asyncio
import threading

import pytest

from treadle.engine.types import AdamSpec, SampledSeq, SampleRequest, SampleResult
from treadle.errors import NotFoundError, QuotaExceededError
from treadle.protocol.facts import EngineFacts
from treadle.protocol.ops import Op, OpKind, OptimResult, OptimStep, Outcome, Sample
from treadle.server.config import InputLimits
from treadle.server.core.board import FutureBoard
from treadle.server.core.futures import Futures
from treadle.server.core.limits import Admission
from treadle.server.storage.database import Store
from treadle.server.storage.journal import Journal
from treadle.server.storage.queries import request_row
from treadle.server.tenancy.auth import DEV_TENANT
from treadle.server.tenancy.quotas import QuotaBook, Quotas


class RecordingEngine:
    """Stands in for an engine handle: records queued ops."""

    facts = EngineFacts("m", vocab_size=10, max_seq_len=16, max_lora_rank=8)
    name = "m"

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def submit(self, op: Op) -> None:
        self.ops.append(op)


def run(tmp_path, scenario, quotas: Quotas | None = None) -> None:
    async def main() -> None:
        store = Store(f"sqlite:///{tmp_path / 'treadle.db'}")
        journal = Journal(store.engine)
        journal.start()
        admission = Admission(InputLimits(), QuotaBook(quotas or Quotas(), {}))
        futures = Futures(journal, FutureBoard(asyncio.get_running_loop()), admission, 30.0)
        try:
            await scenario(futures, RecordingEngine())
        finally:
            journal.stop()
            store.close()

    asyncio.run(main())


OPTIM = OptimStep(AdamSpec())
SAMPLE = Sample(SampleRequest([1, 2]))


def test_resubmissions_are_recognised_after_memory_lets_their_keys_go(tmp_path):
    async def scenario(futures: Futures, engine: RecordingEngine) -> None:
        kw = {"tenant": DEV_TENANT, "session_id": "s", "model_id": "s:train:0"}
        train = await futures.file(engine, OpKind.OPTIM_STEP, OPTIM, seq_id=1, **kw)
        sample_kw = {"tenant": DEV_TENANT, "session_id": "s", "sampling_session_id": "smp"}
        sample = await futures.file(engine, OpKind.SAMPLE, SAMPLE, seq_id=7, **sample_kw)
        assert await futures.file(engine, OpKind.OPTIM_STEP, OPTIM, seq_id=1, **kw) == train
        assert len(engine.ops) == 2  # recognised in memory: not queued again

        futures.keys.clear()  # as if many later requests had pushed these keys out
        engine.ops = []
        assert await futures.file(engine, OpKind.OPTIM_STEP, OPTIM, seq_id=1, **kw) == train
        assert await futures.file(engine, OpKind.SAMPLE, SAMPLE, seq_id=7, **sample_kw) == sample
        assert engine.ops == []  # found in the database: nothing runs twice
        # a seq_id never filed is handed on: its worker runs it in order, or refuses it if
        # the model has moved past it (tests/worker/test_scheduler.py)
        await futures.file(engine, OpKind.OPTIM_STEP, OPTIM, seq_id=0, **kw)
        assert [op.seq_id for op in engine.ops] == [0]

    run(tmp_path, scenario)


def test_a_result_reaches_its_poll_from_memory_and_stays_on_disk(tmp_path):
    async def scenario(futures: Futures, engine: RecordingEngine) -> None:
        kw = {"tenant": DEV_TENANT, "session_id": "s", "model_id": "s:train:0", "seq_id": 1}
        rid = await futures.file(engine, OpKind.OPTIM_STEP, OPTIM, **kw)
        poll = asyncio.create_task(futures.poll(rid))
        await asyncio.sleep(0.05)
        assert not poll.done()  # held until the result is written
        release = threading.Event()  # the journal's commits wait for it
        futures.journal.submit(lambda conn: release.wait(10), lambda *_: None)
        futures.finish([Outcome.ok(rid, OptimResult({"grad_norm:mean": 0.5}))])
        await asyncio.sleep(0.3)
        assert not poll.done()  # a client hears of a result only once it is on disk
        release.set()
        polled = await asyncio.wait_for(poll, 10)
        body = b'{"metrics": {"grad_norm:mean": 0.5}}'
        assert polled.finished.result == body and polled.finished.content_type == "application/json"
        assert futures.board.get(rid) is None  # delivered: memory let it go
        row = await futures.journal.run(lambda conn: request_row(conn, rid))
        assert row["status"] == "done" and row["result"] == body
        again = await futures.poll(rid)  # now served from the database
        assert again.finished.result == body and again.kind == "optim_step"

    run(tmp_path, scenario)


def test_in_process_results_are_typed_and_errors_keep_their_class(tmp_path):
    async def scenario(futures: Futures, engine: RecordingEngine) -> None:
        kw = {"tenant": DEV_TENANT, "session_id": "s", "sampling_session_id": "smp"}
        ok = await futures.file(engine, OpKind.SAMPLE, SAMPLE, **kw)
        gone = await futures.file(engine, OpKind.SAMPLE, SAMPLE, **kw)
        result = SampleResult([SampledSeq([3], [-0.5], "length")])
        futures.finish([Outcome.ok(ok, result), Outcome.failed(gone, NotFoundError("nope"))])
        assert await futures.result(ok) is result  # the engine's own result, no protobuf
        with pytest.raises(NotFoundError, match="nope"):
            await futures.result(gone)
        row = await futures.journal.run(lambda conn: request_row(conn, gone))
        assert row["error"]["error_type"] == "NotFoundError"  # kept for readers of the row

    run(tmp_path, scenario)


def test_a_training_request_refused_by_a_quota_still_fills_its_seq_id(tmp_path):
    async def scenario(futures: Futures, engine: RecordingEngine) -> None:
        kw = {"tenant": DEV_TENANT, "session_id": "s", "model_id": "s:train:0"}
        await futures.file(engine, OpKind.OPTIM_STEP, OPTIM, seq_id=1, **kw)
        with pytest.raises(QuotaExceededError, match="requests_per_minute"):
            await futures.file(engine, OpKind.OPTIM_STEP, OPTIM, seq_id=2, **kw)
        # the rate clears with time: the SDK sends seq 2 again, so nothing fills it
        assert [o.seq_id for o in engine.ops] == [1]

    run(tmp_path, scenario, Quotas(requests_per_minute=1))
