"""Fixtures of the PostgreSQL tests: one server for the whole session (tests/postgres/_pg.py),
a fresh database per test. A test that needs PostgreSQL is skipped, with the reason, where
no PostgreSQL binaries are installed (`.ci/run` installs them)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from _pg import PostgresServer, find_bin_dir

NOT_INSTALLED = (
    "PostgreSQL is not installed (no initdb/pg_ctl on PATH, in /usr/lib/postgresql/*/bin or "
    "in $TREADLE_PG_BIN); `.ci/run` installs it"
)
_names = itertools.count()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    if find_bin_dir() is None:
        pytest.skip(NOT_INSTALLED)
    pytest.importorskip("psycopg")
    server = PostgresServer().start()
    yield server
    server.stop()


@pytest.fixture
def pg_url(postgres: PostgresServer) -> str:
    """A new, empty database on the session's server."""
    return postgres.create_database(f"t{next(_names)}")


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """An empty database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'treadle.db'}"
    return request.getfixturevalue("pg_url")
