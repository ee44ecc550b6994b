"""The schema's migrations (Alembic), run by the Store when it opens a database.

    upgrade(engine)      # an empty database, an older one, or one made before Alembic → head

SQLite and PostgreSQL alike. A database made before the migrations existed (tables, no
alembic_version) is first brought to the initial revision's shape and stamped with it
(versions/0001_initial.py `adopt`), so that no row is lost. On PostgreSQL the upgrade holds
an advisory lock: several API processes starting at once on one database migrate it once.

A schema change is a change of treadle.server.storage.rows plus a revision here; Alembic
writes a draft of it from the difference against a database at head:

    python -m treadle.server.storage.migrations revision "what changed" --db sqlite:///x.db
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, inspect, text

log = logging.getLogger("treadle.migrations")
# Alembic tells of every plugin and context it sets up; what it migrates is logged here.
logging.getLogger("alembic").setLevel(logging.WARNING)

HERE = Path(__file__).parent
# pg_advisory_xact_lock key of the schema upgrade (any constant of our own)
UPGRADE_LOCK = 0x7472656164  # "tread"
FIRST = "0001"  # the initial revision: the schema when Alembic took over


def config(connection: Connection | None = None, url: str | None = None) -> Config:
    """Alembic's settings for this folder; the migrations run on `connection`."""
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["connection"] = connection
    return cfg


@functools.cache
def head() -> str:
    """The newest revision (the version files are read once per process)."""
    found = ScriptDirectory.from_config(config()).get_current_head()
    assert found is not None
    return found


def revision(rev: str) -> ModuleType:
    """The module of one revision (its upgrade, downgrade and anything else it defines)."""
    return ScriptDirectory.from_config(config()).get_revision(rev).module


def current(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine) -> None:
    """Bring the database to head (nothing to do costs one read)."""
    with engine.connect() as conn:
        if current(conn) == head():
            return
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":  # one migrator at a time; the others wait
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": UPGRADE_LOCK})
        found = current(conn)
        if found == head():
            return  # another process migrated it while this one waited
        if found is None and inspect(conn).has_table("requests"):
            log.info("adopting a database made before the migrations: revision %s", FIRST)
            revision(FIRST).adopt(conn)
            command.stamp(config(conn), FIRST)
            found = FIRST
        log.info("migrating the database from revision %s to %s", found or "(empty)", head())
        command.upgrade(config(conn), "head")
