"""The server's state and the logic behind the routes: sessions, models, futures, samplers.

Routes stay thin: they parse a body, call one method here and return its value. Errors are
treadle.errors exceptions, mapped to HTTP in one handler (treadle.server.app).

The hot path writes the database once per request and once per result, both through the
journal (treadle.server.journal), and reads it not at all: the sessions, models and samplers
of this process are held in memory (their rows are written when they are made), a
resubmission is recognised in memory, and a result reaches its poll from memory
(treadle.server.notifier). The database remains the record: what is not in memory (a future
of a previous run, one delivered already, an evicted key) is looked up there.

Tenants: every session, model, sampler, checkpoint and future belongs to the tenant of the
request that made it (treadle.server.auth.current_tenant). Another tenant's resource is
answered exactly as one that does not exist (NotFoundError, same message). Quotas
(treadle.server.quotas) and input limits are checked here too, where every route's
operations pass (`submit`), so that no path escapes them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from treadle.errors import InvalidRequestError, NotFoundError, TreadleError
from treadle.server import artifacts, limits
from treadle.server.auth import DEV_TENANT, KeyRing, Tenant, current_tenant, in_request
from treadle.server.config import ServerConfig
from treadle.server.db import (
    CheckpointRow,
    ModelRow,
    RequestRow,
    SamplingSessionRow,
    SessionRow,
    Store,
    finish_requests,
    insert_request,
    insert_row,
    mark_session_ended,
    new_id,
    request_id_of,
    request_row,
    sampling_session_id_of,
    set_model_status,
    utcnow,
)
from treadle.server.executor import JSON_TYPE, PROTO_TYPE, OpExecutor
from treadle.server.journal import Journal
from treadle.server.limits import TRAIN_KINDS
from treadle.server.metering import METERED_KINDS, usage_of, with_usage
from treadle.server.notifier import FutureBoard, Outcome
from treadle.server.quotas import QuotaError, Quotas, RateLimiter, check_rank, check_slot
from treadle.server.scheduler import EngineWorker, Op
from treadle.wire import codec

log = logging.getLogger("treadle.service")

# Dedup keys remembered in memory; an older key is still recognised, by the database.
MAX_FILED_KEYS = 100_000
# Owners of futures remembered in memory; an older one is read from its request row.
MAX_REQUEST_OWNERS = 100_000


class SessionGoneError(NotFoundError):
    """The session ended (closed or silent too long); answered with HTTP 410."""


class Service:
    def __init__(self, config: ServerConfig, store: Store, journal: Journal, board: FutureBoard):
        self.config = config
        self.store = store
        self.journal = journal
        self.board = board
        self.workers: dict[str, EngineWorker] = {}  # base model name → its engine worker
        self.executors: dict[str, OpExecutor] = {}
        self.engines: dict[str, Any] = {}
        self.last_seen: dict[str, float] = {}  # active session → monotonic time of last sign
        self.ended: dict[str, str] = {}  # sessions this process ended → finished|expired
        self.models: dict[str, ModelRow] = {}  # training models made by this process
        self.samplers: dict[str, SamplingSessionRow] = {}  # rows read once (they never change)
        # dedup key → request_id, or the commit still in flight for it
        self.filed: OrderedDict[str, str | asyncio.Future[str]] = OrderedDict()
        self.session_tenant: dict[str, str] = {}  # sessions of this process → tenant_id
        self.request_tenant: OrderedDict[str, str] = OrderedDict()  # request_id → tenant_id
        self.rate = RateLimiter(config.rate_window_s)
        self.keyring: KeyRing | None = None  # set by the app; holds the tenants' own quotas

    # ---- engines ----
    def add_engine(self, name: str, engine: Any) -> None:
        executor = OpExecutor(
            engine,
            self.store,
            self.config.artifacts_dir,
            self.config.max_snapshots_per_model,
            journal=self.journal,
        )
        worker = EngineWorker(
            name,
            executor,
            self._finish,
            self.config.max_sample_batch,
            max_merge_tokens=self.config.max_merge_tokens,
        )
        self.engines[name], self.executors[name], self.workers[name] = engine, executor, worker
        worker.start()

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.stop()

    def _finish(self, outcomes: list[Outcome]) -> None:
        """Any thread: hand outcomes to the journal; their polls get them once committed.
        Never blocks, so the engine thread goes on with its next round."""

        def done(_: Any, error: BaseException | None) -> None:
            if error is None:
                self.board.resolve(outcomes)
                return
            log.error("could not record %d results", len(outcomes), exc_info=error)
            message = f"the server could not record this result: {type(error).__name__}: {error}"
            failed = {"status": "failed", "error": {"error": message, "category": "server"}}
            self.board.resolve([{"request_id": o["request_id"], **failed} for o in outcomes])

        self.journal.submit(functools.partial(finish_requests, outcomes=outcomes), done)

    def engine_facts(self, base_model: str) -> tuple[int, int]:
        engine = self.engines[base_model]
        return int(engine.vocab_size), int(engine.max_seq_len)

    def require_base_model(self, name: str | None, field: str = "base_model") -> str:
        if name not in self.workers:
            raise InvalidRequestError(
                f"{field}: model {name!r} is not served here; served: {sorted(self.workers)}"
            )
        return name

    # ---- tenants: ownership and quotas ----
    @staticmethod
    def owns(tenant_id: str | None) -> bool:
        """Whether the request being served may see a resource of `tenant_id` (work done
        outside a request, on the engine and journal threads, sees everything)."""
        return not in_request() or (tenant_id or DEV_TENANT.tenant_id) == current_tenant().tenant_id

    def quotas_of(self, tenant: Tenant) -> Quotas:
        quotas = self.config.quotas
        if tenant.name in self.config.tenant_quotas:
            quotas = quotas.overlay(self.config.tenant_quotas[tenant.name].model_dump())
        if self.keyring is not None:
            quotas = quotas.overlay(self.keyring.quotas_seen.get(tenant.tenant_id))
        return quotas

    def _check_adapter_slot(self, tenant: Tenant, quotas: Quotas) -> None:
        limit = quotas.max_adapters_in_memory
        if limit is None:
            return
        held = self.adapters_in_memory(tenant.tenant_id)
        check_slot(
            "max_adapters_in_memory", limit, held, f"tenant {tenant.name!r} holds {held} adapters"
        )

    def adapters_in_memory(self, tenant_id: str) -> int:
        """Training models loaded, plus samplers loaded from saved checkpoints."""
        models = sum(
            1 for m in self.models.values() if m.tenant_id == tenant_id and m.status == "active"
        )
        samplers = sum(
            1
            for s in self.samplers.values()
            if s.tenant_id == tenant_id
            and s.engine_ref is not None
            and s.engine_ref.startswith("sampler:")
            and s.engine_ref in self.executors[s.base_model].live_refs
        )
        return models + samplers

    def default_max_tokens(self, base_model: str, prompt_len: int) -> int | None:
        """max_tokens for a sample request that gives none, under the input limits."""
        context = self.engine_facts(base_model)[1]
        return limits.default_max_tokens(self.config.limits, base_model, context, prompt_len)

    # ---- sessions ----
    async def create_session(self, body: Any) -> str:
        tenant = current_tenant()
        limit = self.quotas_of(tenant).max_concurrent_sessions
        if limit is not None:
            mine = [s for s in self.last_seen if self.session_tenant.get(s) == tenant.tenant_id]
            what = f"tenant {tenant.name!r} has {len(mine)} active sessions"
            check_slot("max_concurrent_sessions", limit, len(mine), what)
        session_id = new_id()
        values = {
            "session_id": session_id,
            "tenant_id": tenant.tenant_id,
            "status": "active",
            "tags": list(body.tags),
            "user_metadata": body.user_metadata,
            "display_name": body.display_name,
            "sdk_version": body.sdk_version,
            "created_at": utcnow(),
        }
        await self.journal.run(functools.partial(insert_row, cls=SessionRow, values=values))
        self.session_tenant[session_id] = tenant.tenant_id
        self.last_seen[session_id] = time.monotonic()
        return session_id

    def require_session(self, session_id: str) -> None:
        """An active session of this process (and a sign of life from it), else 404/410."""
        owner = self.session_tenant.get(session_id)
        if owner is not None and not self.owns(owner):
            raise NotFoundError(f"session_id {session_id!r} not found")
        if session_id in self.last_seen:
            self.last_seen[session_id] = time.monotonic()
            return
        status = self.ended.get(session_id)
        if status is None:  # not one of ours: ended by a previous run, or no such session
            row = self.store.get(SessionRow, session_id)
            if row is None or not self.owns(row.tenant_id):
                raise NotFoundError(f"session_id {session_id!r} not found")
            status = row.status if row.status != "active" else "ended"
        raise SessionGoneError(
            f"session {session_id!r} has {status}; its models were unloaded "
            "(saved checkpoints remain): create a new session"
        )

    async def end_session(self, session_id: str, status: str) -> None:
        """Mark the session ended and free its adapters and samplers from engine memory."""
        self.last_seen.pop(session_id, None)
        self.ended[session_id] = status
        models, samplers = await self.journal.run(
            functools.partial(mark_session_ended, session_id=session_id, status=status)
        )
        reason = f"session {session_id!r} {status} before this request ran"
        waits = []
        for model_id, base_model in models:
            if model_id in self.models:
                self.models[model_id].status = "unloaded"
            if base_model in self.workers:
                waits.append(self._on_engine(base_model, self._unload, model_id, reason))
        for sampling_session_id, base_model, engine_ref in samplers:
            self.samplers.pop(sampling_session_id, None)
            if engine_ref and base_model in self.executors:
                ex = self.executors[base_model]
                waits.append(self._on_engine(base_model, ex.drop_ref, engine_ref))
        for fut in waits:
            try:
                await asyncio.wrap_future(fut)
            except Exception:
                log.exception("freeing session %s", session_id)

    def _on_engine(self, base_model: str, fn: Any, *args: Any) -> concurrent.futures.Future:
        return self.workers[base_model].call(lambda: fn(*args))

    def _unload(self, model_id: str, reason: str) -> None:
        """Engine thread: fail the model's queued ops, then free its adapter and snapshots."""
        base = self._model_row(model_id).base_model
        self.workers[base].remove_model(model_id, reason)
        self.executors[base].drop_model(model_id)

    async def expire_idle_sessions(self) -> list[str]:
        cutoff = time.monotonic() - self.config.heartbeat_timeout_s
        idle = [sid for sid, seen in list(self.last_seen.items()) if seen < cutoff]
        for sid in idle:
            log.info(
                "session %s silent for over %.0f s: ending it", sid, self.config.heartbeat_timeout_s
            )
            await self.end_session(sid, "expired")
        return idle

    # ---- models ----
    def _model_row(self, model_id: str) -> ModelRow | None:
        row = self.models.get(model_id)
        return row if row is not None else self.store.get(ModelRow, model_id)

    def require_model(self, model_id: str, field: str = "model_id") -> ModelRow:
        row = self._model_row(model_id)
        if row is None or not self.owns(row.tenant_id):
            raise NotFoundError(f"{field}: model {model_id!r} not found")
        self.require_session(row.session_id)
        worker = self.workers.get(row.base_model)
        if worker is None or not worker.has_model(model_id):
            why = "was unloaded" if row.status == "unloaded" else "is not loaded (server restart)"
            raise NotFoundError(
                f"{field}: model {model_id!r} {why}; create a training client from one of its "
                "checkpoints"
            )
        return row

    async def unload_model(self, model_id: str) -> str:
        """Free a model's adapter now (its checkpoints stay); → the future's request_id."""
        row = self.require_model(model_id)
        rid = new_id()
        self.board.expect(rid, "unload")
        self._note_owner(rid, row.tenant_id)
        values = {
            "request_id": rid,
            "kind": "unload",
            "tenant_id": row.tenant_id,
            "base_model": row.base_model,
            "session_id": row.session_id,
            "model_id": model_id,
        }
        await self.journal.run(functools.partial(insert_row, cls=RequestRow, values=values))

        def run() -> None:
            row.status = "unloaded"
            self.journal.submit(
                functools.partial(set_model_status, model_id=model_id, status="unloaded"),
                _log_error,
            )
            self._unload(model_id, f"model {model_id!r} was unloaded before this request ran")
            result = {"model_id": model_id, "type": "unload_model"}
            self._finish([OpExecutor.ok(Op(rid, "unload", model_id), result)])

        self.workers[row.base_model].call(run)
        return rid

    def find_run(self, run_or_model_id: str) -> ModelRow:
        rows = self.store.query(
            select(ModelRow).where(
                (ModelRow.run_id == run_or_model_id) | (ModelRow.model_id == run_or_model_id)
            )
        )
        rows = [r for r in rows if self.owns(r.tenant_id)]
        if not rows:
            raise NotFoundError(f"training run {run_or_model_id!r} not found")
        return rows[0]

    async def new_model(
        self,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        lora: dict,
        user_metadata: dict | None,
    ) -> str:
        """The model "<session_id>:train:<model_seq_id>", made once (a resubmit finds it)."""
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            return model_id
        tenant = current_tenant()
        quotas = self.quotas_of(tenant)
        check_rank(quotas, int(lora.get("rank") or 0))
        self._check_adapter_slot(tenant, quotas)
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
            if model_id not in self.models:  # made by an identical request meanwhile
                raise
        if model_id not in self.models:
            self.models[model_id] = ModelRow(**values)
            self.workers[base_model].add_model(model_id)
        return model_id

    # ---- futures ----
    @contextlib.asynccontextmanager
    async def skip_on_error(self, row: ModelRow, seq_id: int | None) -> AsyncIterator[None]:
        """A training request refused at the edge still uses up its seq_id: the SDK has
        reserved it, and the model's later requests must not wait for it forever. A failed
        future is filed in its place (a resubmission finds it), then the 400 goes out."""
        try:
            yield
        except (InvalidRequestError, QuotaError) as e:
            if isinstance(e, QuotaError) and e.retry_after_s is not None:
                raise  # cleared by waiting: the SDK sends this very request again
            if seq_id is not None:
                try:
                    await self.submit(
                        self.workers[row.base_model],
                        "skip",
                        str(e),
                        session_id=row.session_id,
                        model_id=row.model_id,
                        seq_id=seq_id,
                    )
                except TreadleError:
                    pass  # the seq_id was taken already: nothing to fill
            raise

    async def submit(
        self,
        worker: EngineWorker,
        kind: str,
        payload: Any,
        *,
        session_id: str | None,
        model_id: str | None = None,
        seq_id: int | None = None,
        sampling_session_id: str | None = None,
    ) -> str:
        """File a future and queue its op; a resubmitted (model or sampler, seq_id) gets the
        original request_id back and is not queued again.

        One database write: the request row, committed by the journal before the reply
        goes out; the journal thread hands the op to the engine thread right after the
        commit (never before: a write that fails queues nothing).
        """
        owner = model_id if sampling_session_id is None else sampling_session_id
        key = f"{owner}#{seq_id}" if owner is not None and seq_id is not None else None
        if key is not None and (found := await self._known(key)) is not None:
            return found
        if kind != "sample":
            if seq_id is None:
                raise InvalidRequestError("seq_id: required for training requests")
            try:
                worker.check_seq(model_id, seq_id)
            except InvalidRequestError:
                # a seq_id that ran long ago: a resubmission whose key memory let go
                if (found := await self._filed_in_db(key)) is not None:
                    return found
                raise
        tenant = current_tenant()
        tenant_id = self.session_tenant.get(session_id or "", tenant.tenant_id)
        base_model = getattr(worker, "name", None)  # the served model (prices are per model)
        if kind != "skip":
            try:
                quota = self.quotas_of(tenant).max_tokens_per_request
                limits.check_request(self.config.limits, quota, base_model, kind, payload)
            except (InvalidRequestError, QuotaError) as e:
                if kind in TRAIN_KINDS:  # the seq_id is spent: later requests must not wait
                    await self.submit(
                        worker,
                        "skip",
                        str(e),
                        session_id=session_id,
                        model_id=model_id,
                        seq_id=seq_id,
                    )
                raise
            self.rate.take(tenant.tenant_id, self.quotas_of(tenant).requests_per_minute)
        rid = new_id()
        op = Op(rid, kind, model_id, seq_id, payload)
        values = {
            "request_id": rid,
            "kind": kind,
            "tenant_id": tenant_id,
            "base_model": base_model,
            "session_id": session_id,
            "model_id": model_id,
            "sampling_session_id": sampling_session_id,
            "seq_id": seq_id,
            "dedup_key": key,
        }
        self.board.expect(rid, kind)
        self._note_owner(rid, tenant_id)
        committed = self.journal.run(
            functools.partial(insert_request, values=values), then=lambda _: worker.submit(op)
        )
        # bookkeeping in a callback, so that it happens even if this request is cancelled
        committed.add_done_callback(functools.partial(self._settled, key, rid))
        if key is not None:
            self.filed[key] = committed
        try:
            return await asyncio.shield(committed)
        except IntegrityError:
            # filed before under this key, by a request whose key memory let go
            if (found := await self._filed_in_db(key)) is not None:
                return found
            raise

    def _note_owner(self, request_id: str, tenant_id: str) -> None:
        self.request_tenant[request_id] = tenant_id
        while len(self.request_tenant) > MAX_REQUEST_OWNERS:
            self.request_tenant.popitem(last=False)

    def _settled(self, key: str | None, rid: str, committed: asyncio.Future) -> None:
        if not committed.cancelled() and committed.exception() is None:
            if key is not None:
                self._remember(key, rid)
            return
        self.board.forget(rid)
        if key is not None and self.filed.get(key) is committed:
            del self.filed[key]

    async def _known(self, key: str) -> str | None:
        known = self.filed.get(key)
        if known is None or isinstance(known, str):
            return known
        try:  # an identical request is being filed right now: its answer is ours
            return await asyncio.shield(known)
        except Exception:
            return await self._filed_in_db(key)

    def _remember(self, key: str, rid: str) -> None:
        self.filed[key] = rid
        self.filed.move_to_end(key)
        while len(self.filed) > MAX_FILED_KEYS:
            oldest, value = next(iter(self.filed.items()))
            if not isinstance(value, str):
                break  # never drop a commit in flight
            del self.filed[oldest]

    async def _filed_in_db(self, key: str | None) -> str | None:
        if key is None:
            return None
        found = await self.journal.run(functools.partial(request_id_of, dedup_key=key))
        if found is not None:
            self._remember(key, found)
        return found

    async def retrieve(self, request_id: str, want_proto: bool) -> tuple[bytes, str]:
        """Long-poll a future: → (body, content type) of its result, error or try_again."""
        filed = self.board.get(request_id)
        owner = self.request_tenant.get(request_id)
        if filed is not None and owner is not None:
            if not self.owns(owner):
                raise NotFoundError(f"request_id {request_id!r} not found")
            outcome = await self.board.wait(filed, self.config.long_poll_s)
            if outcome is None:
                return _try_again(request_id)
            self.board.delivered(request_id)
            self.request_tenant.pop(request_id, None)
            return _reply(request_id, filed.kind, outcome, want_proto)
        # Not in memory: a future of a previous run, or one delivered already.
        row = await self.journal.run(functools.partial(request_row, request_id=request_id))
        if row is None or not self.owns(row["tenant_id"]):
            raise NotFoundError(f"request_id {request_id!r} not found")
        if filed is not None:  # ours, in memory, but its owner was forgotten: now checked
            self._note_owner(request_id, row["tenant_id"])
            return await self.retrieve(request_id, want_proto)
        if row["status"] == "pending":
            # Pending futures stay in memory until their outcome is committed; one pending on
            # disk only was answered already, with the error that its result was not recorded.
            error = {
                "error": f"request {request_id!r}: its result was not recorded",
                "category": "server",
            }
            return json.dumps(error).encode(), JSON_TYPE
        return _reply(request_id, row["kind"], row, want_proto)

    # ---- samplers ----
    async def sampler(self, sampling_session_id: str) -> SamplingSessionRow:
        row = self.samplers.get(sampling_session_id)
        if row is None:  # made by a snapshot on the engine thread, or by a previous run
            row = await self._read(self.store.get, SamplingSessionRow, sampling_session_id)
            if row is None or not self.owns(row.tenant_id):
                raise NotFoundError(f"sampling_session_id {sampling_session_id!r} not found")
            self.samplers[sampling_session_id] = row
        if not self.owns(row.tenant_id):
            raise NotFoundError(f"sampling_session_id {sampling_session_id!r} not found")
        return row

    async def create_sampling_session(self, body: Any, source: Any = None) -> str:
        """`source`: a model package version fetched to a folder (registry.load_source), for
        a model_path whose plain folder is not on this server (encrypted, or in S3)."""
        self.require_session(body.session_id)
        key = (body.session_id, body.sampling_session_seq_id)
        existing = await self.journal.run(functools.partial(sampling_session_id_of, key=key))
        if existing is not None:
            return existing
        sid = new_id()
        if body.model_path:
            ckpt = source or await self.checkpoint(body.model_path, "model_path")
            base = ckpt.base_model
            if body.base_model and body.base_model != base:
                raise InvalidRequestError(
                    f"base_model: {body.base_model!r} does not match the checkpoint's {base!r}"
                )
            self.require_base_model(base)
            self._check_adapter_slot(current_tenant(), self.quotas_of(current_tenant()))
            ref = f"sampler:{sid}"
            ex = self.executors[base]
            await asyncio.wrap_future(
                self.workers[base].call(
                    lambda: ex.load_sampler(ref, ckpt.checkpoint_type, ckpt.dir)
                )
            )
        else:
            base, ref = self.require_base_model(body.base_model), None
        values = {
            "sampling_session_id": sid,
            "session_id": body.session_id,
            "tenant_id": current_tenant().tenant_id,
            "seq_id": body.sampling_session_seq_id,
            "base_model": base,
            "model_path": body.model_path,
            "model_id": None,
            "engine_ref": ref,
            "created_at": utcnow(),
        }
        await self.journal.run(functools.partial(insert_row, cls=SamplingSessionRow, values=values))
        self.samplers[sid] = SamplingSessionRow(**values)
        return sid

    async def checkpoint(self, path: str, field: str = "path") -> CheckpointRow:
        artifacts.parse_tinker_path(path, field)
        row = await self._read(self.store.get, CheckpointRow, path)
        if row is None or not self.owns(row.tenant_id):
            raise NotFoundError(f"{field}: checkpoint {path!r} not found")
        return row

    @staticmethod
    async def _read(fn: Callable[..., Any], *args: Any) -> Any:
        """A read off the event loop (rare paths: the hot path reads nothing)."""
        return await asyncio.to_thread(fn, *args)


def _log_error(_: Any, error: BaseException | None) -> None:
    if error is not None:
        log.error("a database write failed", exc_info=error)


def _try_again(request_id: str) -> tuple[bytes, str]:
    body = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    return json.dumps(body).encode(), JSON_TYPE


def _reply(request_id: str, kind: str, outcome: Any, want_proto: bool) -> tuple[bytes, str]:
    """The retrieve_future body of a finished future (an outcome dict or a row mapping)."""
    if outcome["status"] == "failed":
        return json.dumps(outcome["error"]).encode(), JSON_TYPE
    result, content_type = outcome["result"], outcome["content_type"]
    if content_type == PROTO_TYPE and not want_proto:
        result, content_type = _proto_as_json(request_id, kind, result), JSON_TYPE
    if kind not in METERED_KINDS:
        return result, content_type
    return with_usage(result, content_type, usage_of(outcome)), content_type


def _proto_as_json(request_id: str, kind: str, result: bytes) -> bytes:
    if kind == "sample":
        resp = codec.decode_sample_response(result)
        for i, seq in enumerate(resp.sequences):
            seq.sequence_id = sample_sequence_id(request_id, i)
        return resp.model_dump_json().encode()
    return codec.decode_forward_backward_output(result).model_dump_json().encode()


def sample_sequence_id(request_id: str, index: int) -> str:
    return f"{request_id}:{index}"
