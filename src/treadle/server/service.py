"""The server's state and the logic behind the routes: sessions, models, futures, samplers.

Routes stay thin: they parse a body, call one method here and return its value. Errors are
treadle.errors exceptions, mapped to HTTP in one handler (treadle.server.app).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import select

from treadle.errors import InvalidRequestError, NotFoundError, TreadleError
from treadle.server import artifacts
from treadle.server.config import ServerConfig
from treadle.server.db import (
    CheckpointRow,
    ModelRow,
    RequestRow,
    SamplingSessionRow,
    SessionRow,
    Store,
    new_id,
    utcnow,
)
from treadle.server.executor import PROTO_TYPE, OpExecutor
from treadle.server.notifier import FutureNotifier
from treadle.server.scheduler import EngineWorker, Op
from treadle.wire import codec

log = logging.getLogger("treadle.service")


class SessionGoneError(NotFoundError):
    """The session ended (closed or silent too long); answered with HTTP 410."""


class Service:
    def __init__(self, config: ServerConfig, store: Store, notifier: FutureNotifier):
        self.config = config
        self.store = store
        self.notifier = notifier
        self.workers: dict[str, EngineWorker] = {}  # base model name → its engine worker
        self.executors: dict[str, OpExecutor] = {}
        self.engines: dict[str, Any] = {}
        self.last_seen: dict[str, float] = {}  # session_id → monotonic time of last sign of life
        self.pending: set[str] = set()  # request ids submitted by this process, not finished

    # ---- engines ----
    def add_engine(self, name: str, engine: Any) -> None:
        executor = OpExecutor(
            engine, self.store, self.config.artifacts_dir, self.config.max_snapshots_per_model
        )
        worker = EngineWorker(name, executor, self._finish, self.config.max_sample_batch)
        self.engines[name], self.executors[name], self.workers[name] = engine, executor, worker
        worker.start()

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.stop()

    def _finish(self, outcomes: list[dict[str, Any]]) -> None:
        """Engine thread: persist outcomes, then wake their polls."""
        self.store.finish_requests(outcomes)
        ids = [o["request_id"] for o in outcomes]
        self.pending.difference_update(ids)
        self.notifier.notify(ids)

    def engine_facts(self, base_model: str) -> tuple[int, int]:
        engine = self.engines[base_model]
        return int(engine.vocab_size), int(engine.max_seq_len)

    def require_base_model(self, name: str | None, field: str = "base_model") -> str:
        if name not in self.workers:
            raise InvalidRequestError(
                f"{field}: model {name!r} is not served here; served: {sorted(self.workers)}"
            )
        return name

    # ---- sessions ----
    def create_session(self, body: Any) -> str:
        session_id = new_id()
        self.store.add(
            SessionRow(
                session_id=session_id,
                tags=list(body.tags),
                user_metadata=body.user_metadata,
                display_name=body.display_name,
                sdk_version=body.sdk_version,
            )
        )
        self.last_seen[session_id] = time.monotonic()
        return session_id

    def require_session(self, session_id: str) -> SessionRow:
        row = self.store.get(SessionRow, session_id)
        if row is None:
            raise NotFoundError(f"session_id {session_id!r} not found")
        if row.status != "active":
            raise SessionGoneError(
                f"session {session_id!r} has {row.status}; its models were unloaded "
                "(saved checkpoints remain): create a new session"
            )
        self.last_seen[session_id] = time.monotonic()
        return row

    async def end_session(self, session_id: str, status: str) -> None:
        """Mark the session ended and free its adapters and samplers from engine memory."""
        self.store.set(SessionRow, session_id, status=status, ended_at=utcnow())
        self.last_seen.pop(session_id, None)
        reason = f"session {session_id!r} {status} before this request ran"
        models = self.store.query(select(ModelRow).where(ModelRow.session_id == session_id))
        samplers = self.store.query(
            select(SamplingSessionRow).where(SamplingSessionRow.session_id == session_id)
        )
        waits = []
        for m in models:
            if m.base_model in self.workers:
                waits.append(self._on_engine(m.base_model, self._unload, m.model_id, reason))
            self.store.set(ModelRow, m.model_id, status="unloaded")
        for s in samplers:
            if s.engine_ref and s.base_model in self.executors:
                ex = self.executors[s.base_model]
                waits.append(self._on_engine(s.base_model, ex.drop_ref, s.engine_ref))
        for fut in waits:
            try:
                await asyncio.wrap_future(fut)
            except Exception:
                log.exception("freeing session %s", session_id)

    def _on_engine(self, base_model: str, fn: Any, *args: Any) -> concurrent.futures.Future:
        return self.workers[base_model].call(lambda: fn(*args))

    def _unload(self, model_id: str, reason: str) -> None:
        """Engine thread: fail the model's queued ops, then free its adapter and snapshots."""
        base = self.store.get(ModelRow, model_id).base_model
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
    def require_model(self, model_id: str, field: str = "model_id") -> ModelRow:
        row = self.store.get(ModelRow, model_id)
        if row is None:
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

    def unload_model(self, model_id: str) -> str:
        """Free a model's adapter now (its checkpoints stay); → the future's request_id."""
        row = self.require_model(model_id)
        rid = new_id()
        self.store.add(
            RequestRow(request_id=rid, kind="unload", session_id=row.session_id, model_id=model_id)
        )
        self.pending.add(rid)

        def run() -> None:
            self.store.set(ModelRow, model_id, status="unloaded")
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
        if not rows:
            raise NotFoundError(f"training run {run_or_model_id!r} not found")
        return rows[0]

    def new_model(
        self,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        lora: dict,
        user_metadata: dict | None,
    ) -> str:
        model_id = f"{session_id}:train:{model_seq_id}"
        if self.store.get(ModelRow, model_id) is None:
            self.store.add(
                ModelRow(
                    model_id=model_id,
                    run_id=new_id(),
                    session_id=session_id,
                    base_model=base_model,
                    lora_config=lora,
                    user_metadata=user_metadata,
                )
            )
            self.workers[base_model].add_model(model_id)
        return model_id

    # ---- futures ----
    @contextlib.contextmanager
    def skip_on_error(self, row: ModelRow, seq_id: int | None) -> Iterator[None]:
        """A training request refused at the edge still uses up its seq_id: the SDK has
        reserved it, and the model's later requests must not wait for it forever. A failed
        future is filed in its place (a resubmission finds it), then the 400 goes out."""
        try:
            yield
        except InvalidRequestError as e:
            if seq_id is not None:
                try:
                    self.submit(
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

    def submit(
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
        original request_id back and is not queued again."""
        owner = model_id if sampling_session_id is None else sampling_session_id
        dedup_key = f"{owner}#{seq_id}" if owner is not None and seq_id is not None else None
        if (found := self._filed(dedup_key)) is not None:
            return found
        if kind != "sample":
            if seq_id is None:
                raise InvalidRequestError("seq_id: required for training requests")
            try:
                worker.check_seq(model_id, seq_id)
            except InvalidRequestError:
                # an identical request filed concurrently since our lookup is a resubmission
                if (found := self._filed(dedup_key)) is not None:
                    return found
                raise
        row = RequestRow(
            request_id=new_id(),
            kind=kind,
            session_id=session_id,
            model_id=model_id,
            sampling_session_id=sampling_session_id,
            seq_id=seq_id,
            dedup_key=dedup_key,
        )
        row, created = self.store.insert_request(row)
        if created:
            self.pending.add(row.request_id)
            worker.submit(Op(row.request_id, kind, model_id, seq_id, payload))
        return row.request_id

    def _filed(self, dedup_key: str | None) -> str | None:
        if dedup_key is None:
            return None
        rows = self.store.query(select(RequestRow).where(RequestRow.dedup_key == dedup_key))
        return rows[0].request_id if rows else None

    async def retrieve(self, request_id: str, want_proto: bool) -> tuple[bytes, str]:
        """Long-poll a future: → (body, content type) of its result, error or try_again."""
        row = self.store.get(RequestRow, request_id)
        if row is None:
            raise NotFoundError(f"request_id {request_id!r} not found")
        if row.status == "pending":
            await self.notifier.wait(
                request_id, lambda: request_id not in self.pending, self.config.long_poll_s
            )
            row = self.store.get(RequestRow, request_id)
        if row.status == "pending":
            body = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            return json.dumps(body).encode(), "application/json"
        if row.status == "failed":
            return json.dumps(row.error).encode(), "application/json"
        if row.content_type == PROTO_TYPE and not want_proto:
            return self._proto_as_json(row), "application/json"
        return row.result, row.content_type

    @staticmethod
    def _proto_as_json(row: RequestRow) -> bytes:
        if row.kind == "sample":
            resp = codec.decode_sample_response(row.result)
            for i, seq in enumerate(resp.sequences):
                seq.sequence_id = sample_sequence_id(row.request_id, i)
            return resp.model_dump_json().encode()
        return codec.decode_forward_backward_output(row.result).model_dump_json().encode()

    # ---- samplers ----
    def sampler(self, sampling_session_id: str) -> SamplingSessionRow:
        row = self.store.get(SamplingSessionRow, sampling_session_id)
        if row is None:
            raise NotFoundError(f"sampling_session_id {sampling_session_id!r} not found")
        return row

    async def create_sampling_session(self, body: Any) -> str:
        self.require_session(body.session_id)
        existing = self.store.query(
            select(SamplingSessionRow).where(
                (SamplingSessionRow.session_id == body.session_id)
                & (SamplingSessionRow.seq_id == body.sampling_session_seq_id)
            )
        )
        if existing:
            return existing[0].sampling_session_id
        sid = new_id()
        if body.model_path:
            ckpt = self.checkpoint(body.model_path, "model_path")
            base = ckpt.base_model
            if body.base_model and body.base_model != base:
                raise InvalidRequestError(
                    f"base_model: {body.base_model!r} does not match the checkpoint's {base!r}"
                )
            self.require_base_model(base)
            ref = f"sampler:{sid}"
            ex = self.executors[base]
            await asyncio.wrap_future(
                self.workers[base].call(
                    lambda: ex.load_sampler(ref, ckpt.checkpoint_type, ckpt.dir)
                )
            )
        else:
            base, ref = self.require_base_model(body.base_model), None
        self.store.add(
            SamplingSessionRow(
                sampling_session_id=sid,
                session_id=body.session_id,
                seq_id=body.sampling_session_seq_id,
                base_model=base,
                model_path=body.model_path,
                engine_ref=ref,
            )
        )
        return sid

    def checkpoint(self, path: str, field: str = "path") -> CheckpointRow:
        artifacts.parse_tinker_path(path, field)
        row = self.store.get(CheckpointRow, path)
        if row is None:
            raise NotFoundError(f"{field}: checkpoint {path!r} not found")
        return row


def sample_sequence_id(request_id: str, index: int) -> str:
    return f"{request_id}:{index}"
