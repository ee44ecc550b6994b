"""One ZMQ socket with an IO thread of its own, that any thread may send on directly.

A ZMQ socket must never be used by two threads at once. Here every use of it (a send from
any thread, the IO thread's receives) holds one lock, so the sending thread itself puts its
frames on the wire: an op leaves the journal thread, an outcome the engine thread, with no
hand-over to another thread (each such hop cost a wake-up and a wait for the interpreter
lock, a few tenths of a millisecond on the round trip of every call).

The IO thread never blocks inside libzmq: it waits in `selectors` on the socket's ZMQ_FD
(and a wake-up pipe), then receives under the lock until the socket is empty. ZMQ_FD is
edge-triggered: any operation on the socket may consume its signal. So after every send,
still under the lock, the sender checks ZMQ_EVENTS and wakes the IO thread if input is
waiting; a message never sits unread. Ticks (every `tick_s`) carry heartbeats and liveness
checks only; no work waits for them.

    channel = Channel(zmq.ROUTER, bind="tcp://127.0.0.1:5555", on_message=handle, on_tick=beat)
    channel.start(); channel.send([identity, b"op", body]); channel.stop()
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
import time
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
        # inproc:// (a worker on a thread of the API process) needs one context for both ends
        self._inproc = (bind or connect or "").startswith("inproc://")
        self.ctx = zmq.Context.instance() if self._inproc else zmq.Context()
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
        self._lock = threading.Lock()  # held for every use of the socket
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._on_message = on_message
        self._on_tick = on_tick
        self.tick_s = tick_s
        self._stopping = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="channel", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0, linger_s: float = 0.0) -> None:
        """Close the socket; messages sent and not yet gone get up to linger_s to leave (a
        process's last word before it exits)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wake()
        self._thread.join(timeout_s)
        with self._lock:  # no sender is inside send() now, and none will write the pipe
            self._closed = True
            self.socket.close(int(linger_s * 1000))
            os.close(self._wake_r)
            os.close(self._wake_w)
        if not self._inproc:
            self.ctx.term()

    def send(self, frames: list[bytes]) -> None:
        """Any thread: put frames on the socket now (in order, per sending thread)."""
        with self._lock:
            if self._closed:
                return
            self.socket.send_multipart(frames, copy=False)
            # the send may have taken the FD's signal of input that arrived meanwhile
            if self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._wake()

    def _wake(self) -> None:
        # never after stop() closed the pipe: its descriptors may belong to another file
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the IO thread has wake-ups pending) or closed

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        with self._lock:  # a sender may be on the socket already
            fd = self.socket.getsockopt(zmq.FD)
        selector.register(fd, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        next_tick = time.monotonic() + self.tick_s
        try:
            while not self._stopping.is_set():
                frames = self._drain()
                for message in frames:
                    self._dispatch(message)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + self.tick_s
                    if self._on_tick is not None:
                        self._on_tick()
                if frames:
                    continue  # more may have come while these were handled
                selector.select(max(0.0, next_tick - time.monotonic()))
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                except OSError:  # closed by a stop() that gave up waiting for this thread
                    return
        finally:
            selector.close()

    def _drain(self) -> list[list[bytes]]:
        """Every message waiting on the socket (receiving until it is empty re-arms ZMQ_FD)."""
        messages: list[list[bytes]] = []
        with self._lock:
            while not self._closed:
                try:
                    messages.append(self.socket.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
        return messages

    def _dispatch(self, frames: list[bytes]) -> None:
        try:
            self._on_message(frames)
        except Exception:  # one bad message must not stop the channel
            log.exception("could not handle a message")
