"""Training models: one LoRA adapter each, "<session_id>:train:<model_seq_id>", made once.

The models this process made are held in memory (the hot path reads no database); one made
by a previous run is read from its row, to say what became of it.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from treadle.artifacts.folders import remove_state_folders
from treadle.errors import InvalidRequestError, NotFoundError
from treadle.protocol.ops import ModelResult, OpKind, Outcome
from treadle.server.core.futures import Futures
from treadle.server.core.limits import Admission
from treadle.server.core.sessions import Sessions
from treadle.server.engines.served import Engines
from treadle.server.registry.bindings import Bindings
from treadle.server.storage.database import Store
from treadle.server.storage.journal import Journal
from treadle.server.storage.queries import drop_states, insert_row, set_model_status
from treadle.server.storage.rows import ModelRow, RequestRow, new_id, utcnow
from treadle.server.tenancy.auth import Tenant, owns
from treadle.types import TRAINING_SESSION_NAME

log = logging.getLogger("treadle.models")


class TrainingModels:
    def __init__(
        self,
        store: Store,
        journal: Journal,
        sessions: Sessions,
        engines: Engines,
        admission: Admission,
        futures: Futures,
        bindings: Bindings,
    ):
        self.store = store
        self.journal = journal
        self.sessions = sessions
        self.engines = engines
        self.admission = admission
        self.futures = futures
        self.bindings = bindings
        self._rows: dict[str, ModelRow] = {}  # training models made by this process

    def row(self, model_id: str) -> ModelRow | None:
        """The caller's model, from memory or its row. Another tenant's is read from the
        database like an unknown id (the read is filtered to the caller's rows, so it finds
        nothing): both cost the same, and a leaked id's liveness cannot be timed."""
        found = self._rows.get(model_id)
        if found is not None and owns(found.tenant_id):
            return found
        return self.store.get(ModelRow, model_id)

    def require(self, model_id: str, field: str = "model_id") -> ModelRow:
        """A loaded model of the caller's tenant whose session is active, else 404/410.
        Loaded means: made (or restored) by this process and not unloaded since, on a base
        model served here; the worker that holds it answers for the rest."""
        row = self.row(model_id)
        if row is None or not owns(row.tenant_id):
            raise NotFoundError(f"{field}: model {model_id!r} not found")
        if row.unloaded_reason is not None and not self.loaded(row):
            # the server gave it up, or it holds weights only (a copy, an upload): say why
            raise NotFoundError(f"{field}: {row.unloaded_reason}")
        self.sessions.require(row.session_id)
        if not self.loaded(row):
            why = "was unloaded" if row.status == "unloaded" else "is not loaded (server restart)"
            raise NotFoundError(
                f"{field}: model {model_id!r} {why}; create a training client from one of its "
                "checkpoints"
            )
        return row

    async def refiled(self, model_id: str, seq_id: int | None) -> str | None:
        """A resubmission, to a model no longer loaded, of a request it filed before: its
        reply was lost (a crash between the commit and the reply), so the client sends it
        again. It gets the original request_id, whose result says what became of it, not
        the 404 a new request gets. None for any other request (and for a loaded model,
        whose filing finds the resubmission itself, with no read here)."""
        known = self._rows.get(model_id)
        if seq_id is None or (known is not None and self.loaded(known)):
            return None
        row = self.row(model_id)
        if row is None or not owns(row.tenant_id):
            return None
        return await self.futures.filed_as(model_id, seq_id)

    def loaded(self, row: ModelRow) -> bool:
        return (
            self._rows.get(row.model_id) is row
            and row.status == "active"
            and row.base_model in self.engines
        )

    def restore(self, row: ModelRow) -> None:
        """A model of a previous run whose session is still active (its worker restores its
        state: treadle.server.core.recovery)."""
        self._rows[row.model_id] = row

    def rows_of(self, base_model: str) -> list[ModelRow]:
        """The loaded models of one served base model."""
        return [
            r for r in self._rows.values() if r.base_model == base_model and r.status == "active"
        ]

    def active_count(self, tenant_id: str) -> int:
        return sum(
            1 for m in self._rows.values() if m.tenant_id == tenant_id and m.status == "active"
        )

    def live(self, tenant_id: str) -> list[ModelRow]:
        """The tenant's models that can serve requests now."""
        return [
            row
            for row in list(self._rows.values())
            if row.tenant_id == tenant_id
            and self.loaded(row)
            and self.sessions.is_active(row.session_id)
        ]

    async def create(
        self,
        tenant: Tenant,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        lora: dict,
        user_metadata: dict | None,
        held_adapters: int,
    ) -> ModelRow:
        """The model "<session_id>:train:<model_seq_id>", made once (a resubmit finds it).
        `held_adapters`: what the tenant holds now (its adapter quota)."""
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self._rows:
            return self._rows[model_id]
        engine = self.engines.require(base_model)
        rank = int(lora.get("rank") or 0)
        self.admission.check_rank(tenant, rank)
        if rank > engine.facts.max_lora_rank:
            raise InvalidRequestError(
                f"lora_config.rank: {rank} exceeds the largest useful rank of {base_model!r}, "
                f"{engine.facts.max_lora_rank} (the width of its layers)"
            )
        self.admission.check_adapters(tenant, held_adapters)
        now = utcnow()
        values = {
            "model_id": model_id,
            "run_id": new_id(),
            "session_id": session_id,
            "tenant_id": tenant.tenant_id,
            "base_model": base_model,
            "lora_config": lora,
            "user_metadata": user_metadata,
            "status": "active",
            "created_at": now,
            "last_request_time": now,
        }
        try:
            await self.journal.run(functools.partial(insert_row, cls=ModelRow, values=values))
        except IntegrityError:
            if model_id not in self._rows:  # made by an identical request meanwhile
                raise
        if model_id not in self._rows:
            self._rows[model_id] = ModelRow(**values)
        name = (user_metadata or {}).get(TRAINING_SESSION_NAME)
        if isinstance(name, str) and name.strip():
            await self.sessions.name(session_id, name.strip()[:256])
        return self._rows[model_id]

    async def bind(self, row: ModelRow, group: str | None, output_path: str | None) -> None:
        """Bind a new model to its model package group: its saves become versions there."""
        if group is not None:
            await asyncio.to_thread(
                self.bindings.bind, row.model_id, row.tenant_id, group, output_path
            )

    async def unload(self, model_id: str) -> str:
        """Free a model's adapter now (its checkpoints stay); → the future's request_id."""
        row = self.require(model_id)
        rid = new_id()
        self.futures.expect(rid, OpKind.UNLOAD, row.tenant_id)
        values = {
            "request_id": rid,
            "kind": str(OpKind.UNLOAD),
            "tenant_id": row.tenant_id,
            "base_model": row.base_model,
            "session_id": row.session_id,
            "model_id": model_id,
        }
        await self.journal.run(functools.partial(insert_row, cls=RequestRow, values=values))
        row.status = "unloaded"
        self.journal.submit(
            functools.partial(set_model_status, model_id=model_id, status="unloaded"), _log_error
        )
        self._forget_states([model_id])
        engine = self.engines.require(row.base_model)
        reason = f"model {model_id!r} was unloaded before this request ran"

        async def run() -> None:
            try:
                await engine.call("unload_model", model_id=model_id, reason=reason)
                outcome = Outcome.ok(rid, ModelResult(model_id, "unload_model"))
            except Exception as e:  # noqa: BLE001 - the future says what went wrong
                outcome = Outcome.failed(rid, e)
            self.futures.finish([outcome])

        asyncio.get_running_loop().create_task(run())
        return rid

    async def on_session_ended(self, models: list[tuple[str, str]], reason: str) -> None:
        """Free the adapters of a session that ended (their rows say so by now)."""
        self._forget_states([model_id for model_id, _ in models])
        for model_id, base_model in models:
            if model_id in self._rows:
                self._rows[model_id].status = "unloaded"
            engine = self.engines.get(base_model)
            if engine is None:
                continue
            try:
                await engine.call("unload_model", model_id=model_id, reason=reason)
            except Exception:
                log.exception("freeing model %s", model_id)

    async def give_up(self, row: ModelRow, reason: str) -> None:
        """The server cannot go on with this model (it could not be restored after a
        restart): free it, and keep why in its row, so that every later request hears the
        reason and no later start tries its restore again."""
        self._rows.setdefault(row.model_id, row)
        row.status, row.unloaded_reason = "unloaded", reason
        unloaded = functools.partial(
            set_model_status, model_id=row.model_id, status="unloaded", reason=reason
        )
        self.journal.submit(unloaded, _log_error)
        await self.on_session_ended([(row.model_id, row.base_model)], reason)

    def _forget_states(self, model_ids: list[str]) -> None:
        """Nothing restores a model no longer loaded: its state snapshot goes, after the
        write that unloaded it (one still on its way is refused as it arrives)."""

        def remove(folders: list[str] | None, error: BaseException | None) -> None:
            _log_error(folders, error)
            if folders:
                remove_state_folders(folders)

        if model_ids:
            self.journal.submit(functools.partial(drop_states, model_ids=model_ids), remove)

    def find_run(self, run_or_model_id: str) -> ModelRow:
        rows = self.store.query(
            select(ModelRow).where(
                (ModelRow.run_id == run_or_model_id) | (ModelRow.model_id == run_or_model_id)
            )
        )
        rows = [r for r in rows if owns(r.tenant_id)]
        if not rows:
            raise NotFoundError(f"training run {run_or_model_id!r} not found")
        return rows[0]


def _log_error(_: object, error: BaseException | None) -> None:
    if error is not None:
        log.error("a database write failed", exc_info=error)
