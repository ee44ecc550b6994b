"""The storage tests run on both databases: `db_url` is an empty one of each kind (the
PostgreSQL server and its fresh databases are tests/conftest.py's `postgres` and `pg_url`)."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """An empty database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'treadle.db'}"
    return request.getfixturevalue("pg_url")
