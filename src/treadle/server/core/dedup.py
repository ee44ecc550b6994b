"""Dedup keys: the request a (model_id, seq_id) or (sampling_session_id, seq_id) was filed as.

A resubmitted key gets the original request_id back, so nothing runs twice. Memory holds
the most recent MAX_FILED_KEYS keys, each with its request_id or, while its row is being
committed, the commit itself (an identical request arriving meanwhile waits for it and gets
the same answer); an older key is found in the database, by the request row's dedup_key.

    keys = FiledKeys(journal)
    found = await keys.known(key)            # memory, then the database; None: new
    keys.filing(key, committed)              # the row's commit in flight
    keys.remember(key, request_id)           # once committed
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict

from treadle.server.storage.journal import Journal
from treadle.server.storage.queries import request_id_of

# Dedup keys remembered in memory; an older key is still recognised, by the database.
MAX_FILED_KEYS = 100_000


class FiledKeys:
    def __init__(self, journal: Journal):
        self.journal = journal
        # dedup key → request_id, or the commit still in flight for it
        self._keys: OrderedDict[str, str | asyncio.Future[str]] = OrderedDict()

    async def known(self, key: str) -> str | None:
        """The request_id filed under `key`, from memory (waiting for a commit in flight)."""
        known = self._keys.get(key)
        if known is None or isinstance(known, str):
            return known
        try:  # an identical request is being filed right now: its answer is ours
            return await asyncio.shield(known)
        except Exception:
            return await self.in_db(key)

    async def in_db(self, key: str | None) -> str | None:
        """The request_id the database holds for `key` (remembered from then on)."""
        if key is None:
            return None
        found = await self.journal.run(functools.partial(request_id_of, dedup_key=key))
        if found is not None:
            self.remember(key, found)
        return found

    def filing(self, key: str, committed: asyncio.Future[str]) -> None:
        self._keys[key] = committed

    def remember(self, key: str, request_id: str) -> None:
        self._keys[key] = request_id
        self._keys.move_to_end(key)
        while len(self._keys) > MAX_FILED_KEYS:
            oldest, value = next(iter(self._keys.items()))
            if not isinstance(value, str):
                break  # never drop a commit in flight
            del self._keys[oldest]

    def failed(self, key: str, committed: asyncio.Future[str]) -> None:
        """The commit filed under `key` failed: forget it (unless a newer one took its place)."""
        if self._keys.get(key) is committed:
            del self._keys[key]

    def clear(self) -> None:
        self._keys.clear()
