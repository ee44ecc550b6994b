"""Fixtures of the SDK tests, on top of the shared ones in tests/conftest.py.

`server_url` is the shared `treadle serve` process on the tiny model (`treadle_server`); every
test that talks to it makes its own ServiceClient (its own session), so tests stay
independent while paying for the server start once.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def server_url(treadle_server) -> str:
    return treadle_server.url


@pytest.fixture(autouse=True)
def _private_tokenizer_cache(tmp_path, monkeypatch):
    # never touch the user's ~/.cache from a test
    monkeypatch.setenv("TREADLE_CACHE_DIR", str(tmp_path / "cache"))
