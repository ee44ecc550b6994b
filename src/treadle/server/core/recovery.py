"""Recovery: nothing a client was told succeeded is lost when a process dies.

What survives a crash is in the database: sessions, models, samplers, every request with
its payload (the op log, written before the client hears of the request), and each model's
last state snapshot (adapter, AdamW state, step and accumulated gradients after a known
seq_id, written by its engine every few optimizer steps). An engine that starts (the
server's first start, a restart on the same data dir, or a worker process that came back)
gets each of its live models as its last snapshot left it, then the model's later ops in
seq_id order:
- finished ops that changed the state (create, load, forward_backward, optim_step) are
  replayed silently (their outcome was recorded once; nobody hears of it again),
- other finished ops (saves, forwards, refusals) only advance the order,
- unfinished ops run again for real (they were acknowledged) and their outcomes are
  recorded as usual; so do unfinished samples.
Sampling sessions of saved checkpoints are loaded again; those of snapshots come back with
their model's snapshot or with the replay of the op that made them.

Cost: one payload column written with each request row (the same bytes the engine is
sent), and a state snapshot per model every `snapshot_every_steps` optimizer steps.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import time
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from sqlalchemy import select

from treadle.artifacts.folders import remove_state_folders, unnamed_state_folders
from treadle.errors import EngineDeadError, ErrorInfo, NotFoundError, TreadleError
from treadle.protocol.facts import StateSnapshot
from treadle.protocol.messages import decode_payload
from treadle.protocol.ops import STATE_KINDS, ModelResult, Op, OpKind, Outcome, Skip
from treadle.server.core.state import ServerState
from treadle.server.engines.remote import WorkerEngine
from treadle.server.registry import sources
from treadle.server.storage import queries
from treadle.server.storage.rows import (
    CheckpointRow,
    ModelRow,
    SamplingSessionRow,
    SessionRow,
    StateSnapshotRow,
)

log = logging.getLogger("treadle.recovery")
RESTORE_READS = 3  # a snapshot replaced while it loads: read the row again, this many times

_DONE_SKIP = Skip(ErrorInfo("TreadleError", "replayed: finished before the restart", "server"))


class Recovery:
    def __init__(self, state: ServerState):
        self.state = state
        self._samples_restored: set[str] = set()  # served models whose samples came back

    # ---- at start-up: what this process must know again ----
    def load(self) -> None:
        """Sessions, models and pending futures of a previous run, back in memory."""
        store, state = self.state.store, self.state
        with store.session() as s:
            sessions = list(s.scalars(select(SessionRow).where(SessionRow.status == "active")))
            active = {row.session_id for row in sessions}
            models = [
                m
                for m in s.scalars(select(ModelRow).where(ModelRow.status == "active"))
                if m.session_id in active and m.base_model in state.engines
            ]
        for row in sessions:
            state.sessions.restore(row.session_id, row.tenant_id)
        for row in models:
            state.models.restore(row)
        with store.engine.begin() as conn:
            pending = queries.pending_requests(conn)
            unloaded_states = queries.drop_states(conn)  # of models unloaded before a crash
            named = queries.snapshot_folders(conn)
        remove_state_folders(unloaded_states)
        config = state.config
        # this server starts every worker, after this (the ones before died with their
        # server): none is writing a snapshot, so a folder no row names never will be
        if config.start_workers or not config.engine_processes:
            remove_state_folders(unnamed_state_folders(config.state_dir, named))
        gone = self._unloaded_models(
            {r["model_id"] for r in pending} - {m.model_id for m in models}
        )
        lost, dropped = [], []
        for row in pending:
            rid, model_id = row["request_id"], row["model_id"]
            if model_id in gone:  # its model was freed before the crash: its row says so
                if row["kind"] == OpKind.UNLOAD:  # that freeing itself, then: it happened
                    dropped.append(Outcome.ok(rid, ModelResult(model_id, "unload_model")))
                else:
                    dropped.append(Outcome.failed(rid, gone[model_id]))
            elif row["no_payload"]:  # nothing to run it again from
                lost.append(rid)
            else:
                state.futures.expect(row["request_id"], OpKind(row["kind"]), row["tenant_id"])
        if lost:
            error = TreadleError("the server restarted before this request ran; send it again")
            dropped += [Outcome.failed(rid, error) for rid in lost]
        if dropped:
            state.futures.finish(dropped)
        if sessions or pending:
            log.info(
                "recovered %d sessions, %d models, %d unfinished requests",
                len(sessions),
                len(models),
                len(pending) - len(dropped),
            )

    def _unloaded_models(self, model_ids: set[str | None]) -> dict[str, TreadleError]:
        """Of these models, those unloaded (by their user, or given up by the server): → the
        error their unfinished requests fail with."""
        ids = [m for m in model_ids if m is not None]
        if not ids:
            return {}
        with self.state.store.session() as s:
            rows = s.scalars(
                select(ModelRow).where(ModelRow.model_id.in_(ids) & (ModelRow.status == "unloaded"))
            )
            return {
                row.model_id: TreadleError(
                    row.unloaded_reason or f"model {row.model_id!r} was unloaded before this ran"
                )
                for row in rows
            }

    # ---- an engine (re)starts: its models, samplers and unfinished work ----
    async def restore_engine(
        self,
        engine: WorkerEngine,
        model_ids: list[str] | None = None,
        skip: AbstractSet[str] = frozenset(),
    ) -> None:
        """Restore an engine's models (all of its base model's, or `model_ids`: those placed
        on one replica). `skip`: request ids someone else sends again."""
        t0 = time.monotonic()
        # everything already handed to the journal is on disk before we read the log
        await self.state.journal.run(lambda conn: None)
        models = self.state.models.rows_of(engine.name)
        if model_ids is not None:
            models = [m for m in models if m.model_id in set(model_ids)]
        for row in models:
            if (why := engine.unrestorable(row.model_id)) is not None:
                held = {op.request_id for op in _unfinished(engine)}  # the engine fails those
                await self._give_up(engine, row, why, held)
                continue
            try:
                await self._restore_model(engine, row, skip)
            except EngineDeadError:
                # The worker went away meanwhile: this restore stops, and the next worker's
                # restores everything again. Nothing is given up for it (a crash while a
                # model's state loads counts against that model alone: faults.restore_id).
                raise
            except Exception as e:  # one model that cannot come back must not keep the rest
                log.exception("could not restore model %s", row.model_id)
                reason = (
                    f"model {row.model_id!r} could not be restored after a restart "
                    f"({type(e).__name__}: {e}); create a training client from its last "
                    "checkpoint"
                )
                await self._give_up(engine, row, reason)
        await self._restore_samplers(engine)
        samples = []
        if engine.name not in self._samples_restored:  # once per run: later, engines resend
            self._samples_restored.add(engine.name)
            with self.state.store.engine.connect() as conn:
                samples = queries.pending_samples(conn, engine.name)
        in_flight = {op.request_id for op in _unfinished(engine)} | set(skip)
        for row in samples:
            if self._take(row["request_id"], in_flight) and row["payload"] is not None:
                payload = decode_payload(OpKind.SAMPLE, row["payload"])
                self.state.engines.require(engine.name).submit(
                    Op(row["request_id"], OpKind.SAMPLE, payload)
                )
        if models or samples:
            log.info(
                "engine %s: %d models and %d samples restored in %.2f s",
                engine.name,
                len(models),
                len(samples),
                time.monotonic() - t0,
            )

    def _take(self, request_id: str, in_flight: set[str]) -> bool:
        """Whether to hand an unfinished request to the engine: not if it holds it (the
        engine sends those again itself once its worker is back)."""
        return request_id not in in_flight

    async def _restore_model(
        self, engine: WorkerEngine, row: ModelRow, skip: AbstractSet[str] = frozenset()
    ) -> None:
        snap = await self._restore_state(engine, row.model_id)
        after = snap.seq_id if snap is not None else -1
        with self.state.store.engine.connect() as conn:
            log_rows = queries.model_ops_after(conn, row.model_id, after)
        in_flight = {op.request_id for op in _unfinished(engine)} | set(skip)  # after the await
        for r in log_rows:
            kind, seq = OpKind(r["kind"]), r["seq_id"]
            if r["status"] == "pending":
                if not self._take(r["request_id"], in_flight):
                    continue  # sent before the worker went away: the engine sends it again
                payload = decode_payload(kind, r["payload"])
                engine.submit(Op(r["request_id"], kind, payload, row.model_id, seq))
            elif r["status"] == "done" and _replays(kind) and r["payload"] is not None:
                payload = decode_payload(kind, r["payload"])
                engine.submit(Op(r["request_id"], kind, payload, row.model_id, seq, replay=True))
            else:
                engine.submit(
                    Op(r["request_id"], OpKind.SKIP, _DONE_SKIP, row.model_id, seq, replay=True)
                )

    async def _restore_samplers(self, engine: WorkerEngine) -> None:
        """Sampling sessions of saved checkpoints: their weights loaded again."""
        state = self.state
        with state.store.session() as s:
            rows = list(
                s.scalars(
                    select(SamplingSessionRow).where(
                        (SamplingSessionRow.base_model == engine.name)
                        & SamplingSessionRow.engine_ref.like("sampler:%")
                    )
                )
            )
        for row in rows:
            if not state.sessions.is_active(row.session_id) or row.model_path is None:
                continue
            if state.engines.require(engine.name).is_live(row.engine_ref):
                continue  # held by another replica
            try:
                await self._load_sampler(engine, row)
            except EngineDeadError:
                raise  # the worker went away: as for a model above, nothing is given up
            except Exception as e:  # noqa: BLE001 - that sampler answers 404 with the reason
                why = f"its weights could not be loaded again after a restart ({e})"
                state.samplers.not_restored(row.sampling_session_id, why)
                log.warning("sampler %s: %s", row.sampling_session_id, why)

    async def _load_sampler(self, engine: WorkerEngine, row: SamplingSessionRow) -> None:
        """A sampler's checkpoint loaded again: its folder on this server, else its model
        package version fetched again (from S3, say). An encrypted one cannot be: the key
        came with the request that made the sampler, and the server never keeps it."""
        assert row.model_path is not None and row.engine_ref is not None
        ckpt = self.state.store.get(CheckpointRow, row.model_path)
        if ckpt is not None and Path(ckpt.dir).is_dir():
            await engine.call(
                "load_sampler",
                ref=row.engine_ref,
                checkpoint_type=ckpt.checkpoint_type,
                directory=ckpt.dir,
            )
            return
        root = sources.packages_root(self.state.config)
        source = await asyncio.to_thread(
            sources.load_source, self.state.store, root, row.tenant_id, row.model_path, None, False
        )
        if source is None:
            raise NotFoundError(f"its checkpoint {row.model_path!r} is gone")
        try:
            await engine.call(
                "load_sampler",
                ref=row.engine_ref,
                checkpoint_type=source.checkpoint_type,
                directory=source.dir,
            )
        finally:
            if source.cleanup:
                shutil.rmtree(source.dir, ignore_errors=True)

    async def _give_up(
        self,
        engine: WorkerEngine,
        row: ModelRow,
        reason: str,
        held: AbstractSet[str] = frozenset(),
    ) -> None:
        """A model that cannot come back: fail its pending requests (but those in `held`,
        which the engine fails), then free it for good (the journal writes in order: once
        its row says so, those failures are on disk too)."""
        with self.state.store.engine.connect() as conn:
            rows = queries.model_ops_after(conn, row.model_id, -1)
        failed = [r["request_id"] for r in rows if r["status"] == "pending"]
        failed = [rid for rid in failed if rid not in held]
        if failed:
            self.state.futures.finish([Outcome.failed(rid, TreadleError(reason)) for rid in failed])
        await self.state.models.give_up(row, reason)

    async def _restore_state(self, engine: WorkerEngine, model_id: str) -> Any:
        """Load the model's last state snapshot into the engine; → its row (None: none yet).

        A snapshot the worker sent just before it was taken for gone can be recorded while
        this restore runs; recording it deletes the folder it replaces, which may be the one
        read here. The load then fails on a missing folder while the row names a newer
        one: that one is loaded instead (the log replays from its seq_id)."""
        read = functools.partial(asyncio.to_thread, self.state.store.get, StateSnapshotRow)
        snap = await read(model_id)
        for _ in range(RESTORE_READS - 1):
            try:
                await self._load_state(engine, model_id, snap)
                return snap
            except EngineDeadError:
                raise
            except Exception:
                newer = await read(model_id)
                if snap is None or newer is None or newer.dir == snap.dir:
                    raise
                log.info("the snapshot of %s was replaced as it loaded: the new one", model_id)
                snap = newer
        await self._load_state(engine, model_id, snap)  # the last try: its error is the restore's
        return snap

    @staticmethod
    async def _load_state(engine: WorkerEngine, model_id: str, snap: Any) -> None:
        await engine.call(
            "restore_model",
            model_id=model_id,
            state_dir=snap.dir if snap is not None else None,
            samplers=dict(snap.samplers or {}) if snap is not None else {},
            next_seq=(snap.seq_id if snap is not None else -1) + 1,
        )

    # ---- a state snapshot was written ----
    def snapshot_written(self, snap: StateSnapshot) -> None:
        """Any thread: record it (the op log before it can go), then delete what it replaced."""
        write = functools.partial(
            queries.record_snapshot,
            model_id=snap.model_id,
            seq_id=snap.seq_id,
            folder=snap.dir,
            samplers=snap.samplers,
        )

        def done(unnamed: list[str] | None, error: BaseException | None) -> None:
            if error is not None:
                log.error("could not record the snapshot of %s", snap.model_id, exc_info=error)
            elif unnamed:
                remove_state_folders(unnamed)

        self.state.journal.submit(write, done)


def _replays(kind: OpKind) -> bool:
    # a snapshot op recreates its sampler weights (in memory only, when replayed)
    return kind in STATE_KINDS or kind == OpKind.SNAPSHOT


def _unfinished(engine: WorkerEngine) -> list[Op]:
    return engine.unfinished()
