"""The futures this process filed, and their outcomes the moment they are committed.

A submit registers its request (`expect`) before the op can run. Once the journal has
committed the op's outcome, `resolve` (any thread) hands the outcome itself to the event loop:
a `retrieve_future` poll waiting on it returns at once, without reading back the row just
written. No timer polls the database, and the database stays the record: an outcome leaves
memory once delivered (a repeated poll reads the row), and the oldest undelivered ones leave
when too many pile up.

A streamed sample op's future also hears its Progress (tokens as they are sampled, never
recorded): `progress` (any thread) queues them for `updates`, which ends once the outcome
is in.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from treadle.protocol.ops import OpKind, Outcome, Progress

# Undelivered outcomes kept in memory (a client that never polls must not grow the server).
MAX_KEPT = 4096
MAX_KEPT_BYTES = 256 * 2**20


@dataclass
class Filed:
    """One future of this process: its kind, and its outcome once committed."""

    kind: OpKind
    tenant_id: str  # its owner: only they may poll it
    engine: str | None = None  # the served model that runs it (cancel_future asks it)
    outcome: Outcome | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # a streamed op's Progress as it comes, then None once the outcome is in
    updates: asyncio.Queue[Progress | None] | None = None


class FutureBoard:
    """Event-loop side; only `resolve` may be called from other threads."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        max_kept: int = MAX_KEPT,
        max_kept_bytes: int = MAX_KEPT_BYTES,
    ):
        self._loop = loop
        self._filed: dict[str, Filed] = {}
        self._finished: OrderedDict[str, int] = OrderedDict()  # undelivered → result bytes
        self._kept_bytes = 0
        self.max_kept = max_kept
        self.max_kept_bytes = max_kept_bytes

    def expect(
        self,
        request_id: str,
        kind: OpKind,
        tenant_id: str,
        stream: bool = False,
        engine: str | None = None,
    ) -> None:
        updates = asyncio.Queue() if stream else None
        self._filed[request_id] = Filed(kind, tenant_id, engine, updates=updates)

    def forget(self, request_id: str) -> None:
        self._filed.pop(request_id, None)
        self._drop_finished(request_id)

    def get(self, request_id: str) -> Filed | None:
        return self._filed.get(request_id)

    def resolve(self, outcomes: list[Outcome]) -> None:
        """Thread-safe: the outcomes are committed; wake whoever waits on them."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._resolve, outcomes)

    def progress(self, items: list[Progress]) -> None:
        """Thread-safe: tokens of streamed ops, for whoever follows them (`updates`)."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._progress, items)

    def _progress(self, items: list[Progress]) -> None:
        for item in items:
            entry = self._filed.get(item.request_id)
            if entry is not None and entry.updates is not None and entry.outcome is None:
                entry.updates.put_nowait(item)

    async def updates(self, entry: Filed) -> AsyncIterator[Progress]:
        """A streamed future's Progress, in order, until its outcome is in."""
        if entry.updates is None:
            return
        while (item := await entry.updates.get()) is not None:
            yield item
        entry.updates.put_nowait(None)  # for a second reader

    def _resolve(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            rid = outcome.request_id
            entry = self._filed.get(rid)
            if entry is None or entry.outcome is not None:
                continue  # not ours (or already resolved): the database has it
            entry.outcome = outcome
            entry.ready.set()
            if entry.updates is not None:
                entry.updates.put_nowait(None)
            size = len(outcome.body or b"")
            self._finished[rid] = size
            self._kept_bytes += size
        while self._finished and (
            len(self._finished) > self.max_kept or self._kept_bytes > self.max_kept_bytes
        ):
            oldest = next(iter(self._finished))
            self._filed.pop(oldest, None)
            self._drop_finished(oldest)

    async def wait(self, entry: Filed, timeout: float | None) -> Outcome | None:
        """The outcome, or None if `timeout` (None: no limit) passed first."""
        if entry.outcome is None:
            try:
                async with asyncio.timeout(timeout):
                    await entry.ready.wait()
            except TimeoutError:
                return None
        return entry.outcome

    def delivered(self, request_id: str) -> None:
        """The outcome went out: the database serves any later poll of it."""
        entry = self._filed.get(request_id)
        if entry is not None and entry.outcome is not None:
            del self._filed[request_id]
            self._drop_finished(request_id)

    def _drop_finished(self, request_id: str) -> None:
        size = self._finished.pop(request_id, None)
        if size is not None:
            self._kept_bytes -= size

    def __len__(self) -> int:
        return len(self._filed)
