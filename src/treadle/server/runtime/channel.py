"""One ZMQ socket with an IO thread of its own, that any thread may send on.

ZMQ sockets belong to one thread: this one is read and written only by its IO thread,
which sleeps in `zmq.Poller` until a message arrives (from the peer, or from another
thread of this process through an inproc pipe: each sending thread gets its own PUSH end)
or until the next tick. Ticks (every `tick_s`) carry heartbeats and liveness checks only;
no work waits for them.

    channel = Channel(zmq.ROUTER, bind="tcp://127.0.0.1:5555", on_message=handle, on_tick=beat)
    channel.start(); channel.send([identity, b"op", body]); channel.stop()
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import zmq

log = logging.getLogger("treadle.channel")

TICK_S = 0.25


class Channel:
    def __init__(
        self,
        socket_type: int,
        on_message: Callable[[list[bytes]], None],
        on_tick: Callable[[], None] | None = None,
        bind: str | None = None,
        connect: str | None = None,
        identity: bytes | None = None,
        tick_s: float = TICK_S,
    ):
        assert (bind is None) != (connect is None), "bind or connect, not both"
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(socket_type)
        self.socket.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.socket.setsockopt(zmq.IDENTITY, identity)
        if socket_type == zmq.ROUTER:
            # a message for a peer that went away is dropped, not queued forever
            self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if bind is not None:
            self.socket.bind(bind)
        else:
            self.socket.connect(connect)
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pipe = f"inproc://channel-{uuid.uuid4().hex}"
        self._inbox = self.ctx.socket(zmq.PULL)
        self._inbox.bind(self._pipe)
        self._local = threading.local()
        self._senders: list[zmq.Socket] = []
        self._senders_lock = threading.Lock()
        self._on_message = on_message
        self._on_tick = on_tick
        self._tick_ms = int(tick_s * 1000)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="channel", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self.send([b"__stop__"])
        self._thread.join(timeout_s)
        with self._senders_lock:
            for s in self._senders:
                s.close(0)
        self.ctx.term()

    def send(self, frames: list[bytes]) -> None:
        """Any thread: queue frames for the peer (in order, per sending thread)."""
        sender = getattr(self._local, "push", None)
        if sender is None:
            sender = self.ctx.socket(zmq.PUSH)
            sender.setsockopt(zmq.LINGER, 0)
            sender.connect(self._pipe)
            self._local.push = sender
            with self._senders_lock:
                self._senders.append(sender)
        sender.send_multipart(frames, copy=False)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._inbox, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                events = dict(poller.poll(self._tick_ms))
                if self._inbox in events:
                    while True:
                        try:
                            frames = self._inbox.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        if frames[0].bytes == b"__stop__":
                            return
                        self.socket.send_multipart(frames, copy=False)
                if self.socket in events:
                    while True:
                        try:
                            frames = self.socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(frames)
                if self._on_tick is not None:
                    self._on_tick()
        finally:
            self._inbox.close(0)
            self.socket.close(0)

    def _dispatch(self, frames: list[bytes]) -> None:
        try:
            self._on_message(frames)
        except Exception:  # one bad message must not stop the channel
            log.exception("could not handle a message")
