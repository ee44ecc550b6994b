"""Service.submit and retrieve against a real database and journal, without HTTP or an
engine: resubmissions are recognised even once memory has let their keys go, and a result
reaches its poll from memory while the database keeps the record."""

from __future__ import annotations

import asyncio

import pytest

from treadle.errors import InvalidRequestError
from treadle.server.config import ServerConfig
from treadle.server.db import Store, request_row
from treadle.server.journal import Journal
from treadle.server.notifier import FutureBoard
from treadle.server.scheduler import Op
from treadle.server.service import Service


class RecordingWorker:
    """Stands in for the engine worker: records queued ops; seq_ids below `next_seq` ran."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.next_seq = 0

    def check_seq(self, model_id: str, seq_id: int) -> None:
        if seq_id < self.next_seq or any(o.seq_id == seq_id for o in self.ops):
            raise InvalidRequestError(f"seq_id: {seq_id} was already used")

    def submit(self, op: Op) -> None:
        self.ops.append(op)


def run(tmp_path, scenario) -> None:
    async def main() -> None:
        store = Store(f"sqlite:///{tmp_path / 'treadle.db'}")
        journal = Journal(store.engine)
        journal.start()
        config = ServerConfig(models={"m": "unused"}, data_dir=str(tmp_path))
        svc = Service(config, store, journal, FutureBoard(asyncio.get_running_loop()))
        try:
            await scenario(svc, RecordingWorker())
        finally:
            journal.stop()
            store.close()

    asyncio.run(main())


def test_resubmissions_are_recognised_after_memory_lets_their_keys_go(tmp_path):
    async def scenario(svc: Service, worker: RecordingWorker) -> None:
        kw = {"session_id": "s", "model_id": "s:train:0"}
        train = await svc.submit(worker, "forward_backward", "p", seq_id=1, **kw)
        sample_kw = {"session_id": "s", "sampling_session_id": "smp"}
        sample = await svc.submit(worker, "sample", "p", seq_id=7, **sample_kw)
        assert await svc.submit(worker, "forward_backward", "p", seq_id=1, **kw) == train
        assert len(worker.ops) == 2  # recognised in memory: not queued again

        svc.filed.clear()  # as if many later requests had pushed these keys out
        worker.next_seq, worker.ops = 2, []  # seq 1 has run
        assert await svc.submit(worker, "forward_backward", "p", seq_id=1, **kw) == train
        assert await svc.submit(worker, "sample", "p", seq_id=7, **sample_kw) == sample
        assert worker.ops == []  # found in the database: nothing runs twice
        with pytest.raises(InvalidRequestError, match="seq_id"):  # never filed: refused
            await svc.submit(worker, "forward_backward", "p", seq_id=0, **kw)

    run(tmp_path, scenario)


def test_a_result_reaches_its_poll_from_memory_and_stays_on_disk(tmp_path):
    async def scenario(svc: Service, worker: RecordingWorker) -> None:
        kw = {"session_id": "s", "model_id": "s:train:0", "seq_id": 1}
        rid = await svc.submit(worker, "optim_step", "p", **kw)
        poll = asyncio.create_task(svc.retrieve(rid, want_proto=False))
        await asyncio.sleep(0.05)
        assert not poll.done()  # held until the result is written
        result = {"request_id": rid, "status": "done", "result": b'{"metrics": {}}'}
        svc._finish([{**result, "content_type": "application/json"}])
        body, media_type = await asyncio.wait_for(poll, 10)
        assert body == b'{"metrics": {}}' and media_type == "application/json"
        assert svc.board.get(rid) is None  # delivered: memory let it go
        row = await svc.journal.run(lambda conn: request_row(conn, rid))
        assert row["status"] == "done" and row["result"] == body
        again, _ = await svc.retrieve(rid, want_proto=False)  # now served from the database
        assert again == body

    run(tmp_path, scenario)
