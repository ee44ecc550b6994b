"""Replicas: several worker groups serving one model, seen by the rest of the server as one
EngineClient.

A training model is placed on one replica for its life (the one holding the fewest models
when it was made); its ops, samplers and control calls go there. Samples of the base model
go to the least busy serving replica; samples of a sampler go to a replica that holds its
weights. If a replica stays down longer than `failover_after_s` while another serves, its
models move: each is restored on the other replica from its last snapshot and the op log
(treadle.server.core.recovery), and the ops it had not finished are sent there, in order.
A replica that comes back later only gets the models placed on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from treadle.protocol.facts import EngineFacts, ReplicaStatus
from treadle.protocol.ops import Op, OpKind
from treadle.server.engines.client import EngineClient
from treadle.server.engines.remote import WorkerEngine

log = logging.getLogger("treadle.replicas")

# (replica, model ids to restore on it, request ids sent again by the caller) → restores
# them (treadle.server.core.recovery.Recovery.restore_engine)
Restore = Callable[[WorkerEngine, list[str] | None, set[str]], Awaitable[None]]


class ReplicatedEngine(EngineClient):
    def __init__(
        self,
        name: str,
        make_replica: Callable[[int, Callable[[WorkerEngine], Awaitable[None]]], WorkerEngine],
        restore: Restore,
        loop: asyncio.AbstractEventLoop,
        replicas: int = 1,
        failover_after_s: float = 10.0,
        models_of: Callable[[], list[str]] = list,
    ):
        """`models_of`: the training models of this base model the API holds (placed on a
        replica when the first worker comes back after a restart)."""
        self._name = name
        self._models_of = models_of
        self._make_replica = make_replica
        self._restore = restore
        self._loop = loop
        self.failover_after_s = failover_after_s
        self._lock = threading.RLock()
        self.replicas = [make_replica(i, self.restore_replica) for i in range(replicas)]
        self._placed: dict[str, WorkerEngine] = {}  # training model → its replica
        self._moving: dict[str, list[Op]] = {}  # model being restored elsewhere → held ops

    # ---- facts ----
    @property
    def name(self) -> str:
        return self._name

    @property
    def facts(self) -> EngineFacts:
        for r in self.replicas:
            if r.ready:
                return r.facts
        return self.replicas[0].facts

    @property
    def ready(self) -> bool:
        return any(r.ready for r in self.replicas)

    def status(self) -> list[ReplicaStatus]:
        """Each replica's worker, health and load, with the sessions placed on it."""
        with self._lock:
            placed = dict(self._placed)
        out = []
        for r in self.replicas:
            (mine,) = r.status()
            models = tuple(sorted(m for m, owner in placed.items() if owner is r))
            out.append(dataclasses.replace(mine, model_ids=models))
        return out

    # ---- the hub's side ----
    def slot_for(self, replica: int) -> WorkerEngine:
        """The replica a HELLO takes: the one it names, else the first without a worker
        (a worker beyond the configured count adds a replica)."""
        with self._lock:
            if 0 <= replica < len(self.replicas):
                return self.replicas[replica]
            for r in self.replicas:
                if not r.has_worker:
                    return r
            self.replicas.append(self._make_replica(len(self.replicas), self.restore_replica))
            return self.replicas[-1]

    async def restore_replica(self, replica: WorkerEngine) -> None:
        """A replica's worker said HELLO: restore the models placed on it (models not placed
        yet, after a restart of the API, are placed now, as new ones are)."""
        for model_id in self._models_of():
            self._replica_of(model_id)
        with self._lock:
            mine = [m for m, owner in self._placed.items() if owner is replica]
        await self._restore(replica, mine, set())

    def tick(self) -> None:
        """Hub thread: move the models of a replica down too long to one that serves."""
        for replica in self.replicas:
            down = replica.down_for()
            # a replica given up (its model cannot load there) moves its models at once
            if down is None or (down < self.failover_after_s and replica.failure is None):
                continue
            target = self._least_loaded(exclude=replica)
            if target is None:
                continue
            with self._lock:
                moving = [m for m, owner in self._placed.items() if owner is replica]
            for model_id in moving:
                self._move(model_id, replica, target)

    # ---- EngineClient ----
    def stop(self) -> None:
        for r in self.replicas:
            r.stop()

    def submit(self, op: Op) -> None:
        # a model moving to another replica: its ops, and samples of its live weights, wait
        # for the move (they run there after it, in their order)
        moving = op.payload.request.adapter if op.kind == OpKind.SAMPLE else op.model_id
        with self._lock:
            held = self._moving.get(moving) if moving is not None else None
            if held is not None and not op.replay:
                held.append(op)
                return
        if op.kind == OpKind.SAMPLE:
            self._sampler_replica(op.payload.request.adapter).submit(op)
        else:
            self._replica_of(op.model_id).submit(op)

    def is_live(self, ref: str) -> bool:
        return any(r.is_live(ref) for r in self.replicas)

    async def call(self, name: str, **args: Any) -> Any:
        """A control call where it belongs: a model's on its replica, a new sampler on the
        least loaded one, a sampler's drop on every replica holding it, a cancel on every
        replica."""
        if name in ("unload_model", "restore_model"):
            replica = self._replica_of(args["model_id"])
            if name == "unload_model":
                with self._lock:
                    self._placed.pop(args["model_id"], None)
            return await replica.call(name, **args)
        if name == "drop_ref":
            for r in self.replicas:
                if r.is_live(args["ref"]):
                    await r.call(name, **args)
            return None
        if name == "snapshot_all":
            for r in self.replicas:
                if r.ready:
                    await r.call(name, **args)
            return None
        if name == "cancel":  # wherever the ops are queued or decoding
            stopped: list[str] = []
            for r in self.replicas:
                if r.ready:
                    stopped += await r.call(name, **args) or []
            return stopped
        return await (self._least_loaded() or self.replicas[0]).call(name, **args)

    def unfinished(self) -> list[Op]:
        return [op for r in self.replicas for op in r.unfinished()]

    # ---- placement ----
    def _replica_of(self, model_id: str) -> WorkerEngine:
        with self._lock:
            found = self._placed.get(model_id)
            if found is None:
                found = (
                    self._least_loaded() or self.replicas[len(self._placed) % len(self.replicas)]
                )
                self._placed[model_id] = found
            return found

    def _least_loaded(self, exclude: WorkerEngine | None = None) -> WorkerEngine | None:
        with self._lock:
            load = {id(r): 0 for r in self.replicas}
            for owner in self._placed.values():
                load[id(owner)] += 1
            serving = [r for r in self.replicas if r.ready and r is not exclude]
            return min(serving, key=lambda r: (load[id(r)], len(r.unfinished())), default=None)

    def _sampler_replica(self, adapter: str | None) -> WorkerEngine:
        if adapter is not None:
            with self._lock:
                if adapter in self._placed:  # a live training model's current weights
                    return self._placed[adapter]
            for r in self.replicas:
                if r.is_live(adapter):
                    return r
        return self._least_loaded() or self.replicas[0]

    def _move(self, model_id: str, source: WorkerEngine, target: WorkerEngine) -> None:
        """Hub thread: restore the model on `target` (event loop), then send what waited."""
        with self._lock:
            if self._placed.get(model_id) is not source:
                return
            self._placed[model_id] = target
            self._moving[model_id] = source.take_model(model_id)
        log.warning(
            "replica of %s down for over %.0f s: moving %s to another replica",
            self._name,
            self.failover_after_s,
            model_id,
        )

        async def move() -> None:
            with self._lock:
                held = {op.request_id for op in self._moving.get(model_id, [])}
            try:
                await self._restore(target, [model_id], held)
            except Exception:
                log.exception("could not move %s", model_id)
            with self._lock:
                held = self._moving.pop(model_id, [])
            for op in sorted(held, key=lambda o: (o.seq_id or -1, o.enqueued_at)):
                target.submit(op)

        asyncio.run_coroutine_threadsafe(move(), self._loop)
