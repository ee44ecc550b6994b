"""Alembic's entry point: run the migrations on the connection the Store hands over (or on
sqlalchemy.url, for `alembic` itself)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from treadle.server.storage.rows import Base

config = context.config


def run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=True,  # SQLite alters a table by copying it
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run(connection)
else:
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.begin() as conn:
        run(conn)
    engine.dispose()
