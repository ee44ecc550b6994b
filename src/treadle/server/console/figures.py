"""A training model's per-step figures (step_figures): the server's own, which the console
draws next to the loop's, and the loop's own (log_metrics): their names, the check of a
log_metrics body, and the write that replaces a step's figures.

The loop's own are written whether or not the console runs (`log_user`: the SDK's
TrainingClient.log_metrics keeps working, and a console started later shows them).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, delete, insert
from sqlalchemy.dialects import postgresql, sqlite

from treadle.server.storage.journal import Journal
from treadle.server.storage.rows import StepFigureRow

STEP_FIGURES = StepFigureRow.__table__
# The server's own figures of a step.
LOSS = "server/loss"  # loss:sum per loss token (targets with a non-zero weight)
LOSS_SUM, LOSS_TOKENS, TOKENS = "server/loss_sum", "server/loss_tokens", "server/tokens"
GRAD_NORM, LEARNING_RATE = "server/grad_norm", "server/learning_rate"
SERVER_FIGURES = (LOSS, GRAD_NORM, LEARNING_RATE, TOKENS, LOSS_SUM, LOSS_TOKENS)
MAX_NAME_CHARS = 128
MAX_METRICS_PER_CALL = 512


def write_figures(
    conn: Connection,
    tenant_id: str,
    session_id: str,
    model_id: str,
    step: int,
    values: Mapping[str, float],
    source: str,
    at: float,
) -> None:
    """Replace the figures `values` of (model, step, source): one upsert on SQLite and
    PostgreSQL, a delete and an insert elsewhere."""
    if not values:
        return
    t = STEP_FIGURES
    rows = [
        {
            "tenant_id": tenant_id,
            "session_id": session_id,
            "model_id": model_id,
            "step": step,
            "name": name,
            "value": float(value),
            "source": source,
            "at": at,
        }
        for name, value in values.items()
    ]
    dialect = conn.dialect.name
    if dialect in ("sqlite", "postgresql"):
        module = sqlite if dialect == "sqlite" else postgresql
        stmt = module.insert(t)
        stmt = stmt.on_conflict_do_update(
            index_elements=["model_id", "step", "name", "source"],
            set_={"value": stmt.excluded.value, "at": stmt.excluded.at},
        )
        conn.execute(stmt, rows)
        return
    conn.execute(
        delete(t).where(
            (t.c.model_id == model_id)
            & (t.c.step == step)
            & (t.c.source == source)
            & t.c.name.in_(list(values))
        )
    )
    conn.execute(insert(t), rows)


def check_user_metrics(step: Any, metrics: Any) -> tuple[int, dict[str, float], list[str]]:
    """A log_metrics body → (step, the finite numbers, the names skipped as not finite);
    ValueError naming the field otherwise."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**31:
        raise ValueError(f"step: expected an integer in [0, 2^31), got {step!r}")
    if not isinstance(metrics, dict) or not metrics:
        raise ValueError("metrics: expected a non-empty object of name → number")
    if len(metrics) > MAX_METRICS_PER_CALL:
        raise ValueError(f"metrics: at most {MAX_METRICS_PER_CALL} per call, got {len(metrics)}")
    kept, skipped = {}, []
    for name, value in metrics.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ValueError(f"metrics: names are 1-{MAX_NAME_CHARS} characters, got {name!r}")
        if name.startswith("server/"):
            raise ValueError(f"metrics: {name!r}: the prefix server/ is the server's own")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"metrics.{name}: expected a number, got {value!r}")
        if math.isfinite(value):
            kept[name] = float(value)
        else:
            skipped.append(name)
    return step, kept, skipped


async def log_user(
    journal: Journal,
    tenant_id: str,
    session_id: str,
    model_id: str,
    step: int,
    values: Mapping[str, float],
) -> None:
    """A loop's own figures of one step (TrainingClient.log_metrics), through the journal."""
    write = functools.partial(
        write_figures,
        tenant_id=tenant_id,
        session_id=session_id,
        model_id=model_id,
        step=step,
        values=values,
        source="user",
        at=time.time(),
    )
    await journal.run(write)
