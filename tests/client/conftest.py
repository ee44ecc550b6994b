"""Fixtures of the SDK tests: a real `treadle serve` process on a tiny model, on a free port.

Every test that talks to it makes its own ServiceClient (its own session), so tests stay
independent while paying for the server start once.
"""

from __future__ import annotations

import importlib.util

import pytest

TINY = "treadle/tiny-llama"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from treadle.engine.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", "tiny")


@pytest.fixture(scope="session")
def server_url(tiny_model_dir, tmp_path_factory):
    if importlib.util.find_spec("treadle.server.main") is None:
        pytest.skip("treadle.server.main is not available")
    from treadle.launch import ServerProcess

    data_dir = tmp_path_factory.mktemp("server-data")
    with ServerProcess({TINY: tiny_model_dir}, data_dir) as server:
        yield server.url


@pytest.fixture(autouse=True)
def _private_tokenizer_cache(tmp_path, monkeypatch):
    # never touch the user's ~/.cache from a test
    monkeypatch.setenv("TREADLE_CACHE_DIR", str(tmp_path / "cache"))
