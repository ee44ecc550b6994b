"""Sampling sessions: what a SamplingClient samples from.

A sampling session samples the base model (engine_ref None), a frozen snapshot of a
training model (made by save_weights_and_get_sampling_client on the engine thread), or a
saved checkpoint loaded into the engine as an adapter of its own. Rows never change once
made, so each is read at most once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

from treadle.errors import InvalidRequestError, NotFoundError, SessionGoneError
from treadle.server.core.checkpoints import Checkpoints
from treadle.server.core.sessions import Sessions
from treadle.server.engines.served import Engines
from treadle.server.registry.sources import LoadSource
from treadle.server.storage.database import Store
from treadle.server.storage.journal import Journal
from treadle.server.storage.queries import insert_row, next_client, sampling_session_id_of
from treadle.server.storage.rows import SamplingSessionRow, new_id, utcnow
from treadle.server.tenancy.auth import Tenant, owns

log = logging.getLogger("treadle.samplers")


REPLAY_WAIT_S = 30.0


async def _replays_done(engine: Any, ref: str) -> None:
    """After a restart, the snapshot a sampler samples may be made again by a replay of its
    model's op log, which runs once the engine serves again: wait for that (while replays
    are in flight, up to REPLAY_WAIT_S) rather than refuse the sampler as freed."""
    deadline = time.monotonic() + REPLAY_WAIT_S
    while not engine.is_live(ref) and time.monotonic() < deadline:
        if not any(op.replay for op in engine.unfinished()):
            return
        await asyncio.sleep(0.05)


class Samplers:
    def __init__(
        self,
        store: Store,
        journal: Journal,
        sessions: Sessions,
        engines: Engines,
        checkpoints: Checkpoints,
    ):
        self.store = store
        self.journal = journal
        self.sessions = sessions
        self.engines = engines
        self.checkpoints = checkpoints
        self._rows: dict[str, SamplingSessionRow] = {}
        self._not_restored: dict[str, str] = {}  # sampler → why recovery could not load it

    async def get(self, sampling_session_id: str) -> SamplingSessionRow:
        """The caller's sampling session (of this run or a previous one), else 404. Another
        tenant's is read from the database like an unknown id (same cost, same 404)."""
        row = self._rows.get(sampling_session_id)
        if row is None or not owns(row.tenant_id):  # made by a snapshot, a previous run, ...
            row = await asyncio.to_thread(self.store.get, SamplingSessionRow, sampling_session_id)
            if row is None or not owns(row.tenant_id):
                raise NotFoundError(f"sampling_session_id {sampling_session_id!r} not found")
            self._rows[sampling_session_id] = row
        return row

    async def require_live(self, sampling_session_id: str) -> SamplingSessionRow:
        """A sampling session that can sample now: its session active, its weights in memory."""
        row = await self.get(sampling_session_id)
        try:
            self.sessions.require(row.session_id)
        except SessionGoneError as e:
            raise NotFoundError(str(e)) from e  # not 410: the tinker sampler retries it for hours
        engine = self.engines.get(row.base_model)
        if engine is not None and row.engine_ref is not None:
            await _replays_done(engine, row.engine_ref)
        if engine is None or (row.engine_ref is not None and not engine.is_live(row.engine_ref)):
            why = self._not_restored.get(sampling_session_id) or (
                "its weights were freed from memory (too many newer samplers of the same model)"
            )
            raise NotFoundError(
                f"sampling_session_id {sampling_session_id!r}: {why}; make a new sampling client"
            )
        return row

    def not_restored(self, sampling_session_id: str, why: str) -> None:
        """Recovery could not load this sampler's weights again: its 404 says why."""
        self._not_restored[sampling_session_id] = why

    def live_count(self) -> int:
        """Sampling sessions of this run whose session is active (the metrics' gauge)."""
        rows = list(self._rows.values())
        return sum(1 for s in rows if self.sessions.is_active(s.session_id))

    def loaded_count(self, tenant_id: str) -> int:
        """Samplers of the tenant loaded from saved checkpoints (they hold adapters)."""
        return sum(
            1
            for s in self._rows.values()
            if s.tenant_id == tenant_id
            and s.engine_ref is not None
            and s.engine_ref.startswith("sampler:")
            and (engine := self.engines.get(s.base_model)) is not None
            and engine.is_live(s.engine_ref)
        )

    async def create(
        self,
        tenant: Tenant,
        session_id: str,
        seq_id: int,
        base_model: str | None,
        model_path: str | None,
        source: LoadSource | None,
    ) -> str:
        """A sampling session of the base model, or of a saved checkpoint (`source`: a model
        package version already fetched to a folder, for a model_path whose plain folder is
        not on this server). The same (session_id, seq_id) gives the same id back."""
        self.sessions.require(session_id)
        key = (session_id, seq_id)
        existing = await self.journal.run(functools.partial(sampling_session_id_of, key=key))
        if existing is not None:
            return existing
        sid = new_id()
        if model_path:
            ckpt = source or await self.checkpoints.get(model_path, "model_path")
            base = ckpt.base_model
            if base_model and base_model != base:
                raise InvalidRequestError(
                    f"base_model: {base_model!r} does not match the checkpoint's {base!r}"
                )
            engine = self.engines.require(base)
            ref = f"sampler:{sid}"
            await engine.call(
                "load_sampler", ref=ref, checkpoint_type=ckpt.checkpoint_type, directory=ckpt.dir
            )
        else:
            base, ref = self.engines.require(base_model).name, None
        values = {
            "sampling_session_id": sid,
            "session_id": session_id,
            "tenant_id": tenant.tenant_id,
            "seq_id": seq_id,
            "base_model": base,
            "model_path": model_path,
            "model_id": None,
            "engine_ref": ref,
            "created_at": utcnow(),
        }
        await self.journal.run(functools.partial(insert_row, cls=SamplingSessionRow, values=values))
        self._rows[sid] = SamplingSessionRow(**values)
        return sid

    async def join(self, sampling_session_id: str) -> int:
        """A copy of a sampling client (join_sampling_session): → its clone number, unique
        among the session's clients (the original is 0), so that its seq_ids (from clone ×
        10**9 on) never meet another client's."""
        await self.get(sampling_session_id)  # the caller's, else 404
        return await self.journal.run(
            functools.partial(next_client, sampling_session_id=sampling_session_id)
        )

    async def on_session_ended(self, samplers: list[tuple[str, str, str | None]]) -> None:
        """Free the sampler weights of a session that ended."""
        for sampling_session_id, base_model, engine_ref in samplers:
            self._rows.pop(sampling_session_id, None)
            engine = self.engines.get(base_model)
            if engine_ref and engine is not None:
                try:
                    await engine.call("drop_ref", ref=engine_ref)
                except Exception:
                    log.exception("freeing sampler %s", sampling_session_id)
