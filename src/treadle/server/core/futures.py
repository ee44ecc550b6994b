"""Futures: filing an op (once per (model, seq_id) or (sampler, seq_id)), and its outcome.

One database write per request, one per result, both through the journal:
- `file` commits the request row with the op's payload (the op log that recovery replays:
  treadle.server.core.recovery), then hands the op to its engine (never before: a write
  that fails queues nothing); a resubmitted key gets the original request_id back and
  queues nothing, whether memory still knows the key or only the database does
  (treadle.server.core.dedup);
- `finish` (any thread) encodes outcomes (treadle.server.core.results), commits them (with
  the sequences a record_stability_info sample keeps, treadle.server.core.sequences, and
  the rows of what a save wrote, treadle.server.core.saves), and
  only then wakes their polls (treadle.server.core.board): a client is told of a result
  only once it is on disk; its listeners hear of it after that (spend counting, the
  console's recorder: treadle.server.core.listeners);
- `poll` serves the HTTP long poll (from memory, else from the row), `result` the
  in-process callers (the typed result, or the error raised as its own class), and
  `updates` a streamed sample's tokens as they come (an SSE stream), before its result.

A training request refused at the edge still uses up its seq_id (the SDK reserved it, and
the model's later requests must not wait for it forever): a failed future is filed in its
place with a "skip" op, then the error goes back to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError

from treadle.errors import (
    ErrorInfo,
    InvalidRequestError,
    NotFoundError,
    QuotaExceededError,
    TreadleError,
)
from treadle.protocol.messages import encode_payload
from treadle.protocol.ops import (
    Op,
    OpKind,
    Outcome,
    Payload,
    Progress,
    Result,
    Sample,
    Skip,
)
from treadle.server.core.board import FutureBoard
from treadle.server.core.dedup import FiledKeys
from treadle.server.core.limits import Admission
from treadle.server.core.listeners import OutcomeListener, tell
from treadle.server.core.results import JSON_TYPE, encode, error_json, finished_of_row
from treadle.server.core.saves import commit_saved
from treadle.server.core.sequences import insert_records
from treadle.server.engines.client import EngineClient
from treadle.server.storage.journal import Journal
from treadle.server.storage.queries import (
    Finished,
    finish_requests,
    insert_request,
    request_row,
)
from treadle.server.storage.rows import new_id, utcnow
from treadle.server.tenancy.auth import Tenant, current_key_id, owns

log = logging.getLogger("treadle.futures")


def dedup_key(owner: str | None, seq_id: int | None) -> str | None:
    """What makes a request a resubmission: its model (or sampling session) and seq_id."""
    return f"{owner}#{seq_id}" if owner is not None and seq_id is not None else None


@dataclass
class Polled:
    """What a long poll found: a finished request's stored form, or None while pending."""

    kind: str
    finished: Finished | None


class Futures:
    def __init__(
        self,
        journal: Journal,
        board: FutureBoard,
        admission: Admission,
        long_poll_s: float,
        listeners: list[OutcomeListener] | None = None,
        durable: bool = True,
    ):
        self.journal = journal
        self.durable = durable  # write each op's payload to the op log
        self.board = board
        self.admission = admission
        self.long_poll_s = long_poll_s
        self.listeners = list(listeners or [])  # told of each op filed and finished
        self.keys = FiledKeys(journal)  # dedup key → request_id (treadle.server.core.dedup)
        # after a save's versions are committed: its group's retention (set by the app)
        self.after_saves: Callable[[list[Outcome]], None] = lambda outcomes: None
        # traces (treadle.server.observe.tracing), set by the app when tracing is on
        self.tracing: Any = None

    # ---- filing ----
    async def file(
        self,
        engine: EngineClient,
        kind: OpKind,
        payload: Payload,
        *,
        tenant: Tenant,
        session_id: str | None,
        model_id: str | None = None,
        seq_id: int | None = None,
        sampling_session_id: str | None = None,
    ) -> str:
        """File a future and queue its op; → its request_id (a resubmission's is the
        original's, and nothing is queued again)."""
        key = dedup_key(model_id if sampling_session_id is None else sampling_session_id, seq_id)
        if key is not None and (found := await self.keys.known(key)) is not None:
            return found
        if kind != OpKind.SAMPLE and seq_id is None:
            raise InvalidRequestError("seq_id: required for training requests")
        if kind != OpKind.SKIP:
            try:
                self.admission.check_op(tenant, engine.name, kind, payload)
            except (InvalidRequestError, QuotaExceededError) as e:
                if kind != OpKind.SAMPLE and not _clears_with_time(e):
                    await self._skip(engine, tenant, session_id, model_id, seq_id, e)
                raise
        op = Op(new_id(), kind, payload, model_id, seq_id)
        op.encoded = encode_payload(payload)  # the op log entry, and the worker's message body
        values = {
            "request_id": op.request_id,
            "kind": str(kind),
            "tenant_id": tenant.tenant_id,
            "key_id": current_key_id(),  # per-key spend caps
            "base_model": engine.name,  # the served model: prices are per model
            "session_id": session_id,
            "model_id": model_id,
            "sampling_session_id": sampling_session_id,
            "seq_id": seq_id,
            "dedup_key": key,
            "payload": op.encoded if self.durable else None,
        }
        stream = isinstance(payload, Sample) and payload.stream
        self.board.expect(op.request_id, kind, tenant.tenant_id, stream, engine.name)
        write = functools.partial(insert_request, values=values)
        traced = self.tracing.filing(op) if self.tracing is not None else None
        tell(self.listeners, lambda listener: listener.filed(op, values))

        def hand_on(_: Any) -> None:  # the journal thread, once the row is committed
            if traced is not None:
                traced(op)  # the filing's span ends; its time queued begins
            engine.submit(op)

        committed = self.journal.run(write, then=hand_on)
        # bookkeeping in a callback, so that it happens even if this request is cancelled
        committed.add_done_callback(functools.partial(self._settled, key, op.request_id))
        if key is not None:
            self.keys.filing(key, committed)
        try:
            return await asyncio.shield(committed)
        except IntegrityError:
            # filed before under this key, by a request whose key memory let go
            if (found := await self.keys.in_db(key)) is not None:
                return found
            raise

    async def filed_as(self, owner: str, seq_id: int) -> str | None:
        """The request_id (owner, seq_id) was filed as, from memory or the database."""
        key = dedup_key(owner, seq_id)
        return await self.keys.known(key) or await self.keys.in_db(key)

    async def file_finished(
        self,
        tenant: Tenant,
        kind: str,
        result: bytes,
        *,
        session_id: str | None,
        dedup_key: str | None = None,
    ) -> str:
        """A future finished as it is filed (what the API answers itself, with no engine
        call: create_custom_loss): its row is written with its JSON result; → its id (the
        first one's, for a resubmitted dedup key)."""
        if dedup_key is not None and (found := await self.keys.known(dedup_key)) is not None:
            return found
        rid = new_id()
        values = {
            "request_id": rid,
            "kind": kind,
            "tenant_id": tenant.tenant_id,
            "key_id": current_key_id(),
            "session_id": session_id,
            "dedup_key": dedup_key,
            "status": "done",
            "result": result,
            "content_type": JSON_TYPE,
            "finished_at": utcnow(),
        }
        try:
            await self.journal.run(functools.partial(insert_request, values=values))
        except IntegrityError:
            if dedup_key is not None and (found := await self.keys.in_db(dedup_key)) is not None:
                return found
            raise
        if dedup_key is not None:
            self.keys.remember(dedup_key, rid)
        return rid

    @contextlib.asynccontextmanager
    async def refusing(
        self,
        engine: EngineClient,
        tenant: Tenant,
        session_id: str,
        model_id: str,
        seq_id: int | None,
    ) -> AsyncIterator[None]:
        """Checks made at the edge of a training request: a refusal still fills its seq_id
        (a request naming something not found, a custom loss of another session, too)."""
        try:
            yield
        except (InvalidRequestError, QuotaExceededError, NotFoundError) as e:
            if not _clears_with_time(e) and seq_id is not None:
                await self._skip(engine, tenant, session_id, model_id, seq_id, e)
            raise

    async def _skip(
        self,
        engine: EngineClient,
        tenant: Tenant,
        session_id: str | None,
        model_id: str | None,
        seq_id: int | None,
        error: TreadleError,
    ) -> None:
        try:
            await self.file(
                engine,
                OpKind.SKIP,
                Skip(ErrorInfo.of(error)),
                tenant=tenant,
                session_id=session_id,
                model_id=model_id,
                seq_id=seq_id,
            )
        except TreadleError:
            pass  # the seq_id was taken already (or the model is gone): nothing to fill

    def expect(self, request_id: str, kind: OpKind, tenant_id: str, stream: bool = False) -> None:
        """Register a future of this process before its op can run."""
        self.board.expect(request_id, kind, tenant_id, stream)

    # ---- finishing (any thread; never blocks) ----
    def finish(self, outcomes: list[Outcome]) -> None:
        """Commit the outcomes, then hand them to their polls."""

        def write(conn: Any) -> None:
            for o in outcomes:  # a save's rows, before its result names them
                if o.saved is not None and o.succeeded:
                    commit_saved(conn, o)
            finish_requests(conn, [encode(o) for o in outcomes])
            records = [r for o in outcomes if o.succeeded for r in o.records]
            if records:  # record_stability_info: kept with the result that names them
                insert_records(conn, records)

        def done(_: Any, error: BaseException | None) -> None:
            resolved = outcomes
            if error is not None:
                log.error("could not record %d results", len(outcomes), exc_info=error)
                failed = TreadleError(
                    f"the server could not record this result: {type(error).__name__}: {error}"
                )
                resolved = [Outcome.failed(o.request_id, failed) for o in outcomes]
            self.board.resolve(resolved)
            if error is None and any(o.saved is not None for o in outcomes):
                self.after_saves(outcomes)
            # spend, the console's figures: after, never before, a result
            tell(self.listeners, lambda listener: listener.finished(resolved))

        self.journal.submit(write, done)

    def progress(self, items: list[Progress]) -> None:
        """Any thread: tokens of streamed sample ops, handed to their `updates` readers."""
        self.board.progress(items)

    # ---- results ----
    async def poll(self, request_id: str) -> Polled:
        """Long-poll a future for its HTTP reply: held until it finishes or long_poll_s.
        Another tenant's future is looked up in the database like an unknown one (same
        cost, same 404)."""
        filed = self.board.get(request_id)
        if filed is not None and owns(filed.tenant_id):
            outcome = await self.board.wait(filed, self.long_poll_s)
            if outcome is None:
                return Polled(filed.kind, None)
            self.board.delivered(request_id)
            return Polled(filed.kind, encode(outcome))
        # Not in memory: a future of a previous run, or one delivered already.
        row = await self.journal.run(functools.partial(request_row, request_id=request_id))
        if row is None or not owns(row["tenant_id"]):
            raise NotFoundError(f"request_id {request_id!r} not found")
        if row["status"] == "pending":
            # Pending futures stay in memory until their outcome is committed; one pending on
            # disk only was answered already, with the error that its result was not recorded.
            lost = ErrorInfo("TreadleError", f"request {request_id!r}: its result was not recorded")
            return Polled(row["kind"], Finished(request_id, "failed", error=error_json(lost)))
        return Polled(row["kind"], finished_of_row(row))

    async def result(self, request_id: str) -> Result:
        """In-process callers: the typed result of a future this process filed, or its
        error raised as its own class (NotFoundError, QuotaExceededError, ...)."""
        filed = self.board.get(request_id)
        if filed is None:
            raise TreadleError(f"request {request_id!r} is not a future of this process")
        outcome = await self.board.wait(filed, None)
        self.board.delivered(request_id)
        if outcome.error is not None:
            raise outcome.error.to_exception()
        return outcome.result

    async def updates(self, request_id: str) -> AsyncIterator[Progress]:
        """A streamed sample op's tokens as they are sampled (Progress, in order), until its
        outcome is in; `result` then gives the result. Nothing for other futures."""
        filed = self.board.get(request_id)
        if filed is not None:
            async for item in self.board.updates(filed):
                yield item

    # ---- dedup ----
    def _settled(self, key: str | None, rid: str, committed: asyncio.Future) -> None:
        if not committed.cancelled() and committed.exception() is None:
            if key is not None:
                self.keys.remember(key, rid)
            return
        self.board.forget(rid)
        tell(self.listeners, lambda listener: listener.forget(rid))
        if key is not None:
            self.keys.failed(key, committed)


def _clears_with_time(error: Exception) -> bool:
    """A rate limit clears by waiting: the SDK sends this very request (seq_id) again."""
    return isinstance(error, QuotaExceededError) and error.retry_after_s is not None
