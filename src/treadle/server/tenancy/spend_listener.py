"""Spend counting: the outcome listener (treadle.server.core.listeners) that charges every
operation that ran to the spend caps' counters (treadle.server.tenancy.spend).

Each op is charged from its own request's columns: the tenant, the key it was sent with and
the served model, noted as it is filed (`filed`: the values of its request row), and the
usage its outcome carries. What is noted stays until the op finishes (`finished`) or its
filing fails (`forget`), however many ops are in flight: nothing is evicted, so no op goes
unbilled. Ops a previous run filed and left unfinished are noted at start-up from their
rows (`load`), and charged when they finish here.

The app registers this listener whether or not the console runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from treadle.protocol.ops import Op, Outcome
from treadle.server.storage.rows import RequestRow
from treadle.server.tenancy.spend import SpendBook


@dataclass(frozen=True)
class Charge:
    """Whom one op's usage is charged to."""

    tenant_id: str
    key_id: str | None
    base_model: str | None  # the served model: prices are per model


class SpendListener:
    """Charges each finished op's usage to its tenant and key (any thread)."""

    def __init__(self, book: SpendBook):
        self.book = book
        self._lock = threading.Lock()
        self._filed: dict[str, Charge] = {}  # request_id → whom, until it finishes

    def load(self) -> None:
        """At start-up, before any engine runs: the book's baseline (what finished this day
        and month), and whom each op a previous run left unfinished is charged to."""
        self.book.load()
        r = RequestRow.__table__
        stmt = select(r.c.request_id, r.c.tenant_id, r.c.key_id, r.c.base_model).where(
            r.c.status == "pending"
        )
        with self.book.engine.connect() as conn:
            pending = conn.execute(stmt).all()
        with self._lock:
            for rid, tid, kid, base_model in pending:
                self._filed[rid] = Charge(tid, kid, base_model)

    # ---- the listener ----
    def filed(self, op: Op, values: Mapping[str, Any]) -> None:
        charge = Charge(values["tenant_id"], values.get("key_id"), values.get("base_model"))
        with self._lock:
            self._filed[op.request_id] = charge

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._filed.pop(request_id, None)

    def finished(self, outcomes: list[Outcome]) -> None:
        with self._lock:
            charged = [(o, c) for o in outcomes if (c := self._filed.pop(o.request_id, None))]
        for o, c in charged:  # an outcome heard twice is charged once: its entry is gone
            u = o.usage  # a failed op is charged for what ran of it (a cancelled one)
            counts = (u.prompt_tokens, u.sampled_tokens, u.train_tokens, u.cached_prompt_tokens)
            if o.succeeded or any(counts):
                when = o.finished_at if o.finished_at is not None else time.time()
                self.book.add(c.tenant_id, c.key_id, c.base_model, counts, when)

    def __len__(self) -> int:
        """Ops noted and not finished yet."""
        with self._lock:
            return len(self._filed)
