"""Small server pieces alone: --model parsing, checkpoint names and atomic folders, and the
notifier that ends a long poll."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from treadle.errors import InvalidRequestError
from treadle.server import artifacts
from treadle.server.config import ServerConfig, parse_model_arg
from treadle.server.notifier import FutureNotifier


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


def test_notifier_wakes_a_waiting_poll_from_another_thread():
    async def scenario() -> tuple[bool, float]:
        notifier = FutureNotifier(asyncio.get_running_loop())
        done = {"r1": False}

        def engine_thread():
            time.sleep(0.2)
            done["r1"] = True
            notifier.notify(["r1"])

        threading.Thread(target=engine_thread).start()
        t0 = time.monotonic()
        ok = await notifier.wait("r1", lambda: done["r1"], timeout=20)
        return ok, time.monotonic() - t0

    ok, elapsed = asyncio.run(scenario())
    assert ok and elapsed < 5


def test_notifier_times_out_when_nothing_comes():
    async def scenario() -> bool:
        notifier = FutureNotifier(asyncio.get_running_loop())
        return await notifier.wait("r2", lambda: False, timeout=0.1)

    assert asyncio.run(scenario()) is False
