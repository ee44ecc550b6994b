"""A state snapshot's folders on disk live exactly as long as a row names them.

A worker writes a model's state snapshot (a state folder, and a folder per sampler it still
holds) and never deletes one: a crash before the next snapshot is recorded restores the
last one, samplers included. Recording a newer snapshot hands back what no row names any
more (the state folder replaced, the samplers the model dropped since); unloading a model
hands back all of its folders, and a snapshot of a model unloaded meanwhile is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select, update

from treadle.artifacts.folders import remove_state_folders
from treadle.server.storage import queries
from treadle.server.storage.database import Store
from treadle.server.storage.rows import ModelRow, StateSnapshotRow


@pytest.fixture
def store(db_url):
    store = Store(db_url)
    with store.engine.begin() as conn:
        for model in ("a", "b"):
            values = {"run_id": model, "session_id": "s", "base_model": "m", "lora_config": {}}
            queries.insert_row(conn, ModelRow, {"model_id": model, **values})
    yield store
    store.close()


def snapshot(root: Path, model: str, seq: int, samplers: list[str]) -> tuple[str, dict]:
    """The folders a worker writes: → (state folder, sampler ref → folder)."""
    state = root / model / f"state-{seq}"
    state.mkdir(parents=True)
    folders = {}
    for ref in samplers:
        folder = root / model / "samplers" / ref
        folder.mkdir(parents=True, exist_ok=True)
        folders[ref] = str(folder)
    return str(state), folders


def record(store: Store, model: str, seq: int, state: str, samplers: dict) -> list[str]:
    with store.engine.begin() as conn:
        unnamed = queries.record_snapshot(conn, model, seq, state, samplers)
    remove_state_folders(unnamed)
    return unnamed


def test_samplers_a_model_dropped_go_with_the_snapshot_that_no_longer_names_them(store, tmp_path):
    first = snapshot(tmp_path, "a", 10, ["s8", "s9", "s10"])
    assert record(store, "a", 10, *first) == []
    # s8 and s9 were dropped since: still on disk, as a crash now restores the first one
    second = snapshot(tmp_path, "a", 20, ["s10", "s19", "s20"])
    assert sorted(Path(f).name for f in record(store, "a", 20, *second)) == [
        "s8",
        "s9",
        "state-10",
    ]
    on_disk = sorted(p.name for p in (tmp_path / "a" / "samplers").iterdir())
    assert on_disk == ["s10", "s19", "s20"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["samplers", "state-20"]

    late = snapshot(tmp_path, "a", 15, [])  # from a worker taken for gone: never recorded
    assert record(store, "a", 15, *late) == [late[0]]
    assert record(store, "a", 20, *second) == []  # the same one again deletes nothing
    assert Path(second[0]).is_dir()


def test_unloading_a_model_forgets_its_snapshot_and_refuses_one_still_on_its_way(store, tmp_path):
    record(store, "a", 10, *snapshot(tmp_path, "a", 10, ["s1"]))
    record(store, "b", 10, *snapshot(tmp_path, "b", 10, ["s1"]))
    with store.engine.begin() as conn:
        queries.set_model_status(conn, "a", "unloaded")
        remove_state_folders(queries.drop_states(conn, ["a"]))
    assert not (tmp_path / "a").exists()
    on_its_way = snapshot(tmp_path, "a", 12, ["s2"])
    assert record(store, "a", 12, *on_its_way) == [on_its_way[0], *on_its_way[1].values()]
    assert not (tmp_path / "a").exists()
    with store.engine.connect() as conn:
        kept = conn.execute(select(StateSnapshotRow.model_id)).scalars().all()
    assert kept == ["b"] and (tmp_path / "b" / "state-10").is_dir()


def test_a_start_forgets_the_snapshots_of_models_unloaded_before_a_crash(store, tmp_path):
    record(store, "a", 10, *snapshot(tmp_path, "a", 10, ["s1"]))
    record(store, "b", 10, *snapshot(tmp_path, "b", 10, []))
    with store.engine.begin() as conn:  # the unload's own write, then the crash
        conn.execute(update(ModelRow).where(ModelRow.model_id == "b").values(status="unloaded"))
    with store.engine.begin() as conn:
        remove_state_folders(queries.drop_states(conn))
    assert not (tmp_path / "b").exists()
    assert (tmp_path / "a" / "state-10").is_dir() and (tmp_path / "a" / "samplers" / "s1").is_dir()
