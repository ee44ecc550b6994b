"""A restore reads a model's last state snapshot and has its worker load it. A snapshot the
worker sent just before it was taken for gone can be recorded meanwhile, and recording it
deletes the folder it replaces: the one the restore read. The restore then loads the newer
one, which the row names by then; with no newer one, the missing folder is its error.

Real database and the real recording query; the engine handle stands in for the worker,
which loads a state folder or fails as the engine does on a missing one.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from treadle.errors import InvalidRequestError
from treadle.server.core.recovery import Recovery
from treadle.server.storage import queries
from treadle.server.storage.database import Store
from treadle.server.storage.rows import ModelRow

MODEL = "s:train:0"
MODEL_ROW = {
    "model_id": MODEL,
    "run_id": "r",
    "session_id": "s",
    "base_model": "b",
    "lora_config": {},
}


class Worker:
    """Loads state folders; `meanwhile` runs as the first load begins (the race)."""

    def __init__(self, meanwhile=lambda: None):
        self.loaded: list[tuple[str, int]] = []
        self.meanwhile = meanwhile

    async def call(self, name: str, **kw) -> None:
        assert name == "restore_model"
        if not self.loaded and self.meanwhile is not None:
            self.meanwhile()
            self.meanwhile = None
        folder = Path(kw["state_dir"])
        if not folder.is_dir():
            raise InvalidRequestError("adapter folder must hold ...; found nothing")
        self.loaded.append((folder.name, kw["next_seq"]))


def record(store: Store, seq_id: int, folder: Path) -> None:
    """What the API does with a worker's snapshot: record it, delete the folder replaced."""
    folder.mkdir()
    with store.engine.begin() as conn:
        unnamed = queries.record_snapshot(conn, MODEL, seq_id, str(folder), {})
    for old in unnamed:
        shutil.rmtree(old)


@pytest.fixture
def store(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'treadle.db'}")
    with store.engine.begin() as conn:
        queries.insert_row(conn, ModelRow, MODEL_ROW)
    yield store
    store.close()


def restore(store: Store, worker: Worker):
    recovery = Recovery(SimpleNamespace(store=store))
    return asyncio.run(recovery._restore_state(worker, MODEL))


def test_a_snapshot_replaced_while_it_loads_is_loaded_from_its_successor(store, tmp_path):
    record(store, 4, tmp_path / "state-4")
    worker = Worker(meanwhile=lambda: record(store, 6, tmp_path / "state-6"))
    snap = restore(store, worker)
    assert not (tmp_path / "state-4").exists()  # deleted under the first load
    assert worker.loaded == [("state-6", 7)]
    assert snap.seq_id == 6  # the op log replays from there


def test_a_missing_snapshot_that_nothing_replaced_fails_the_restore(store, tmp_path):
    record(store, 4, tmp_path / "state-4")
    shutil.rmtree(tmp_path / "state-4")
    worker = Worker()
    with pytest.raises(InvalidRequestError, match="found nothing"):
        restore(store, worker)
    assert worker.loaded == []
