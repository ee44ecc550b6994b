"""In-process wake-ups between the engine threads and the API's event loop.

An engine thread writes a result to the database, then calls `notify(request_id)`;
a `retrieve_future` poll waiting on that id returns at once. No timer polls the database.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class FutureNotifier:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._events: dict[str, tuple[asyncio.Event, int]] = {}  # request_id → (event, waiters)

    def notify(self, request_ids: list[str]) -> None:
        """Thread-safe: wake every poll waiting on these ids."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._set, list(request_ids))

    def _set(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            entry = self._events.get(rid)
            if entry is not None:
                entry[0].set()

    async def wait(
        self, request_id: str, is_done: Callable[[], Awaitable[bool] | bool], timeout: float
    ) -> bool:
        """Wait until `is_done()` holds or `timeout` passes; → whether it is done.

        The event is registered before `is_done` is checked, so a result written between
        the check and the wait still wakes us (its notify runs on this loop after us).
        """
        event, waiters = self._events.get(request_id, (asyncio.Event(), 0))
        self._events[request_id] = (event, waiters + 1)
        try:
            done = is_done()
            if isinstance(done, Awaitable):
                done = await done
            if done:
                return True
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except TimeoutError:
                pass
            done = is_done()
            return bool(await done if isinstance(done, Awaitable) else done)
        finally:
            event, waiters = self._events[request_id]
            if waiters <= 1:
                del self._events[request_id]
            else:
                self._events[request_id] = (event, waiters - 1)
