"""The API side of the workers' sockets: one ZMQ ROUTER that every worker connects to.

A worker (treadle.worker) connects its DEALER socket here and says HELLO (its model, its
facts, the hub's token, the replica it wants); the hub checks the token and the protocol,
answers WELCOME and hands it to the WorkerEngine of that replica, which restores the
replica's models on it. A worker it holds already that says HELLO again (it heard nothing
from the API for a while) is welcomed as it is (Welcome.restores false): nothing is restored,
and it keeps its models. After that, messages are routed by the worker's socket identity. A worker that sends nothing for `dead_after_s`
(heartbeats come every tick) is lost: its WorkerEngine hears of it and waits for the next.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from typing import Any

import zmq

from treadle.protocol import messages
from treadle.protocol.channel import TICK_S, Channel
from treadle.protocol.messages import Kind
from treadle.server.engines.remote import WorkerEngine

log = logging.getLogger("treadle.remote")

# Only a worker started elsewhere is found gone this way (one this server started is noticed
# at its exit). Beats go out every TICK_S from the worker's channel thread, which a loaded
# host (CPU-bound rollouts, a GIL-holding step) can starve for seconds: dropping a live
# worker costs a restore of every model it holds and a replay of their ops.
DEAD_AFTER_S = 10.0


class WorkerHub:
    """The API side of the workers' sockets: routes messages by worker identity."""

    def __init__(self, address: str, token: str, dead_after_s: float = DEAD_AFTER_S):
        self.token = token
        self.dead_after_s = dead_after_s
        self.epoch = uuid.uuid4().hex
        self.engines: dict[str, Any] = {}  # model → its ReplicatedEngine (slot_for, tick)
        self._by_identity: dict[bytes, WorkerEngine] = {}
        self._seen: dict[bytes, float] = {}
        self._last_beat = 0.0
        self.channel = Channel(zmq.ROUTER, self._on_message, self._on_tick, bind=address)
        self.address = self.channel.address

    def start(self) -> None:
        self.channel.start()

    def stop(self) -> None:
        self.channel.stop()

    def send(self, identity: bytes, kind: Kind, body: bytes) -> None:
        self.channel.send([identity, kind.encode(), body])

    def worker_exited(self, model: str, replica: int, reason: str, running: list[str]) -> None:
        """The supervisor saw the process end: no need to wait for the heartbeat to lapse.
        `running`: the ops a crashed worker was running (blamed as a fault's are)."""
        group = self.engines.get(model)
        if group is None or replica >= len(group.replicas):
            return
        engine = group.replicas[replica]
        for identity, owner in list(self._by_identity.items()):
            if owner is engine:
                self._by_identity.pop(identity, None)
                self._seen.pop(identity, None)
        if running:
            engine.blame(running, reason)
        engine.lost(reason)

    def worker_given_up(self, model: str, replica: int, reason: str) -> None:
        """No worker of this replica is started again (its model cannot load): its requests
        fail with the reason, and status says it is down and why."""
        group = self.engines.get(model)
        if group is not None and replica < len(group.replicas):
            group.replicas[replica].give_up(reason)

    def attaches(self, model: str, replica: int) -> int:
        """How many workers of this replica have said HELLO (has the last one served?)."""
        group = self.engines.get(model)
        if group is None or replica >= len(group.replicas):
            return 0
        return group.replicas[replica].attaches

    def _on_message(self, frames: list[bytes]) -> None:
        identity, kind, body = frames[0], Kind(frames[1].decode()), frames[2]
        self._seen[identity] = time.monotonic()
        if kind == Kind.HELLO:
            self._hello(identity, messages.decode(body, messages.Hello))
            return
        engine = self._by_identity.get(identity)
        if engine is None:  # a worker this API lost track of (or never knew): start over
            self.send(identity, Kind.REJOIN, b"")
        elif kind != Kind.HEARTBEAT or body:  # a beat's body: the worker's figures
            engine.handle(kind, body)

    def _hello(self, identity: bytes, hello: messages.Hello) -> None:
        group = self.engines.get(hello.facts.name)
        if group is None or not hmac.compare_digest(hello.token.encode(), self.token.encode()):
            log.warning("refused a worker for %r (unknown model or wrong token)", hello.facts.name)
            return
        if hello.protocol != messages.PROTOCOL:
            log.warning("refused a worker speaking protocol %s", hello.protocol)
            return
        if identity in self._by_identity:
            # a repeated HELLO (the worker heard nothing from us for API_SILENT_S: a busy
            # machine) of a worker we kept: it keeps its models, we restore nothing
            kept = messages.Welcome(self.epoch, restores=False)
            self.send(identity, Kind.WELCOME, messages.encode(kept))
            return
        welcome = messages.encode(messages.Welcome(self.epoch, restores=True))
        engine = group.slot_for(hello.replica)
        for old, owner in list(self._by_identity.items()):
            if owner is engine and old != identity:
                self._by_identity.pop(old, None)
                engine.lost("replaced by a new worker")
        self._by_identity[identity] = engine
        self.send(identity, Kind.WELCOME, welcome)
        engine.attach(identity, hello)

    def _on_tick(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= TICK_S:
            self._last_beat = now
            for identity in list(self._by_identity):
                self.send(identity, Kind.HEARTBEAT, b"")
        for identity, seen in list(self._seen.items()):
            if now - seen > self.dead_after_s and identity in self._by_identity:
                engine = self._by_identity.pop(identity)
                self._seen.pop(identity, None)
                engine.lost(f"no heartbeat for {self.dead_after_s:.1f} s")
        for group in self.engines.values():
            for engine in group.replicas:
                engine.tick()
            group.tick()
