"""A round-robin HTTP/1.1 load balancer for tests: each request (not each connection) goes to
the next upstream in turn, on a fresh upstream connection, so that a client's keep-alive
connection still spreads its calls over every server. The turn is kept per path: a loop
whose calls come in a fixed pattern (forward_backward, optim_step, two polls) still sends
each kind of call to every server alternately, the first of each to the first upstream.

    with RoundRobin([8001, 8002]) as lb:
        ServiceClient(base_url=lb.url)
        lb.count(8002, "/api/v1/forward_backward")     # how many went there
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import Counter

from _http import content_length, forward_once


class RoundRobin:
    def __init__(self, ports: list[int], host: str = "127.0.0.1"):
        self.upstreams = [(host, p) for p in ports]
        self._turns: dict[str, itertools.cycle] = {}
        self._lock = threading.Lock()
        self._counts: Counter[tuple[int, str]] = Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def count(self, port: int, path: str | None = None) -> int:
        """Requests sent to the upstream on `port` (of one path, if given)."""
        with self._lock:
            return sum(n for (p, q), n in self._counts.items() if p == port and path in (None, q))

    def __enter__(self) -> RoundRobin:
        self._thread.start()

        async def start() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _pick(self, path: str) -> tuple[str, int]:
        with self._lock:
            turn = self._turns.setdefault(path, itertools.cycle(range(len(self.upstreams))))
            upstream = self.upstreams[next(turn)]
            self._counts[(upstream[1], path)] += 1
            return upstream

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            pass  # the balancer stops
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            path = head.split(b" ", 2)[1].decode().split("?")[0]
            body = await reader.readexactly(content_length(head))
            try:
                response = await forward_once(self._pick(path), head, body)
            except (ConnectionError, asyncio.IncompleteReadError):
                writer.transport.abort()  # the server went away: so does the connection
                return
            writer.write(response)
            await writer.drain()
