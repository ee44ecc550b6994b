"""Small server pieces alone: --model parsing, checkpoint names and atomic folders, the
board that ends a long poll, and the journal that commits requests and results."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest

from treadle.artifacts import folders as artifacts
from treadle.engine.types import TrainResult
from treadle.errors import InvalidRequestError
from treadle.protocol.ops import OpKind, Outcome
from treadle.server.config import ServerConfig, parse_model_arg
from treadle.server.core.board import FutureBoard


def test_parse_model_arg(tmp_path):
    assert parse_model_arg("treadle/tiny=/m/tiny") == ("treadle/tiny", "/m/tiny")
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert parse_model_arg(str(folder)) == ("my-model", str(folder))
    odd = tmp_path / "a=b"
    odd.mkdir()
    assert parse_model_arg(str(odd)) == ("a=b", str(odd))  # an existing path wins over NAME=
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_model_arg("=x")


def test_server_config_defaults(tmp_path):
    cfg = ServerConfig(models={"m": "/x"}, data_dir=str(tmp_path))
    assert cfg.resolved_db_url == f"sqlite:///{tmp_path.resolve() / 'treadle.db'}"
    assert cfg.artifacts_dir == tmp_path.resolve() / "artifacts"
    with pytest.raises(ValueError, match="at least one model"):
        ServerConfig(models={})


@pytest.mark.parametrize("name", ["", "a/b", "..", "x..y", ".hidden", "a\\b", None])
def test_bad_checkpoint_names(name):
    with pytest.raises(InvalidRequestError, match="path"):
        artifacts.check_name(name)


def test_tinker_paths_round_trip():
    path = artifacts.tinker_path("run1", "sampler", "step-3")
    assert path == "tinker://run1/sampler_weights/step-3"
    assert artifacts.parse_tinker_path(path) == ("run1", "sampler", "step-3")
    for bad in ["tinker://run1/weights", "s3://run1/weights/x", "tinker://run1/other/x"]:
        with pytest.raises(InvalidRequestError, match="tinker://"):
            artifacts.parse_tinker_path(bad)


def test_atomic_dir_never_leaves_a_half_checkpoint(tmp_path):
    final = tmp_path / "run" / "weights" / "c"
    with artifacts.atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("one")
    assert (final / "a.txt").read_text() == "one"
    with pytest.raises(RuntimeError), artifacts.atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("interrupted")
    assert (final / "a.txt").read_text() == "one"  # the old one stays whole
    with artifacts.atomic_dir(final) as tmp:
        (tmp / "b.txt").write_text("two")
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]
    assert [p.name for p in final.parent.iterdir()] == ["c"]  # no temp folders left


def test_board_hands_the_outcome_to_a_waiting_poll_from_another_thread():
    outcome = Outcome.ok("r1", TrainResult([], {"loss:sum": 1.0}))

    async def scenario() -> tuple[Outcome | None, float]:
        board = FutureBoard(asyncio.get_running_loop())
        board.expect("r1", OpKind.FORWARD, "t")

        def engine_thread():
            time.sleep(0.2)
            board.resolve([outcome])

        threading.Thread(target=engine_thread).start()
        t0 = time.monotonic()
        got = await board.wait(board.get("r1"), timeout=20)
        return got, time.monotonic() - t0

    got, elapsed = asyncio.run(scenario())
    assert got is outcome and elapsed < 5


def test_board_times_out_when_nothing_comes():
    async def scenario() -> Outcome | None:
        board = FutureBoard(asyncio.get_running_loop())
        board.expect("r2", OpKind.FORWARD, "t")
        return await board.wait(board.get("r2"), timeout=0.1)

    assert asyncio.run(scenario()) is None


def test_board_lets_go_of_delivered_and_of_the_oldest_undelivered_outcomes():
    async def scenario() -> None:
        board = FutureBoard(asyncio.get_running_loop(), max_kept=2)
        for rid in ("a", "b", "c", "d"):
            board.expect(rid, OpKind.SAMPLE, "t")
        board._resolve([Outcome(r, body=b"1") for r in "abc"])
        assert board.get("a") is None  # evicted: the database serves it
        assert board.get("b").outcome is not None and board.get("d").outcome is None
        board.delivered("b")
        assert board.get("b") is None
        board.delivered("d")  # still pending: stays
        assert board.get("d") is not None

    asyncio.run(scenario())


def test_journal_commits_a_batch_and_isolates_a_failing_write(tmp_path):
    from sqlalchemy import create_engine, select

    from treadle.server.storage.database import Store
    from treadle.server.storage.journal import Journal
    from treadle.server.storage.queries import REQUESTS, insert_row
    from treadle.server.storage.rows import RequestRow

    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    journal = Journal(store.engine)
    reader = create_engine(f"sqlite:///{tmp_path / 't.db'}")
    seen: dict[str, tuple] = {}

    def row(rid: str, key: str) -> dict:
        return {"request_id": rid, "kind": "forward", "dedup_key": key}

    def done_for(rid: str):
        def done(value, error):
            with reader.connect() as conn:  # another connection: is it on disk already?
                found = conn.execute(
                    select(REQUESTS.c.request_id).where(REQUESTS.c.request_id == rid)
                )
                seen[rid] = (error, found.first() is not None)

        return done

    # queued before the thread starts: one batch, whose second write breaks the unique key
    for rid, key in (("r1", "k1"), ("r2", "k1"), ("r3", "k3")):
        write = functools.partial(insert_row, cls=RequestRow, values=row(rid, key))
        journal.submit(write, done_for(rid))
    journal.start()
    journal.stop()
    assert seen["r1"] == (None, True) and seen["r3"] == (None, True)
    error, on_disk = seen["r2"]
    assert error is not None and "UNIQUE" in str(error) and not on_disk
    store.close()
    reader.dispose()
