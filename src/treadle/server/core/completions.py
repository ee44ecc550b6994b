"""retrieve_futures: the tinker SDK's one long poll per sampling client (its
`sample_use_retrieve_futures`), instead of one retrieve_future poll per sample.

An outcome listener (treadle.server.core.listeners) notes each sample op as it is filed,
under its target: the sampling session and the clone that sent it (`seq_id // 10**9`: 0 for
the original client, a copy's number from join_sampling_session). Once the op's outcome is
committed it goes into its target's log with the next cursor; a poll returns every entry
after the cursor it sends (holding up to long_poll_s while there is none), and what it has
seen (at or before its cursor) leaves the log. The SDK then fetches each result with one
retrieve_future, which answers from memory or the row as for any future.

Memory only, like the futures board: a log keeps at most MAX_LOG entries (the oldest go
first; their results are still in the database), and a target unpolled for IDLE_S is
forgotten.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from treadle.protocol.ops import Op, OpKind, Outcome

CLONE_STRIDE = 1_000_000_000  # a cloned SamplingClient's seq_ids start at clone_id × this
MAX_LOG = 10_000
IDLE_S = 3600.0

Target = tuple[str, int]  # (sampling_session_id, clone id)


@dataclass
class _Log:
    tenant_id: str
    cursor: int = 0
    entries: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    seen_at: float = field(default_factory=time.monotonic)


class Completions:
    """Event-loop side; `finished` may be called from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, long_poll_s: float):
        self._loop = loop
        self.long_poll_s = long_poll_s
        self._targets: dict[str, Target] = {}  # request_id → its target, until it finishes
        self._logs: dict[Target, _Log] = {}

    # ---- the listener ----
    def filed(self, op: Op, values: Mapping[str, Any]) -> None:
        sid = values.get("sampling_session_id")
        if op.kind == OpKind.SAMPLE and sid is not None and op.seq_id is not None:
            target = (sid, op.seq_id // CLONE_STRIDE)
            self._targets[op.request_id] = target
            self._log(target, values["tenant_id"])

    def forget(self, request_id: str) -> None:
        self._targets.pop(request_id, None)

    def finished(self, outcomes: list[Outcome]) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._add, outcomes)

    def _add(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            target = self._targets.pop(o.request_id, None)
            if target is None or (log := self._logs.get(target)) is None:
                continue
            log.cursor += 1
            entry: dict[str, Any] = {"state": "failed", "request_id": o.request_id}
            if o.error is None:
                size = len(o.body) if o.body is not None else None
                entry = {**entry, "state": "finished", "response_payload_uncompressed_size": size}
            log.entries.append((log.cursor, entry))
            del log.entries[:-MAX_LOG]
            log.changed.set()

    def _log(self, target: Target, tenant_id: str) -> _Log:
        log = self._logs.get(target)
        if log is None:
            now = time.monotonic()
            for stale in [t for t, lg in self._logs.items() if now - lg.seen_at > IDLE_S]:
                del self._logs[stale]
            log = self._logs[target] = _Log(tenant_id)
        return log

    # ---- the poll ----
    async def poll(
        self, target: Target, tenant_id: str, prev_cursor: int, timeout: float | None
    ) -> tuple[list[dict[str, Any]], int]:
        """Completions after `prev_cursor` (dropping those at or before it), held until one
        comes or `timeout` (None: long_poll_s) passes; → (completions, the cursor)."""
        log = self._logs.get(target)
        if log is None:
            log = self._log(target, tenant_id)
        if log.tenant_id != tenant_id:  # another tenant's sampler: as if it had nothing
            return [], prev_cursor
        log.seen_at = time.monotonic()
        if prev_cursor > log.cursor:  # a cursor of before a restart: number on from it
            log.entries = [(prev_cursor + i + 1, e) for i, (_, e) in enumerate(log.entries)]
            log.cursor = prev_cursor + len(log.entries)
        log.entries = [(c, e) for c, e in log.entries if c > prev_cursor]
        wait = self.long_poll_s if timeout is None else min(timeout, self.long_poll_s)
        if not log.entries and wait > 0:
            log.changed.clear()
            try:
                async with asyncio.timeout(wait):
                    await log.changed.wait()
            except TimeoutError:
                pass
            log.entries = [(c, e) for c, e in log.entries if c > prev_cursor]
        if not log.entries:
            return [], max(prev_cursor, 0)
        return [e for _, e in log.entries], log.entries[-1][0]
