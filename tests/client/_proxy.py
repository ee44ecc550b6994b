"""A small HTTP/1.1 proxy that injects transport faults between the SDK and a real server.

Each rule matches a request path and fires on its next `count` matching requests:
- "503": answer 503 without forwarding (the server never sees the request);
- "reset_before": drop the client's connection without forwarding;
- "reset_after": forward, let the server answer, then drop the client's connection before
  it reads the answer (the server executed it; the client cannot know).

    with FaultProxy(upstream_port) as proxy:
        proxy.add_rule("/api/v1/forward_backward", "reset_after")
        ServiceClient(base_url=proxy.url)
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from _http import content_length, forward_once


@dataclass
class Rule:
    path: str
    action: str  # "503" | "reset_before" | "reset_after"
    count: int = 1


class FaultProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self.rules: list[Rule] = []
        self.events: list[tuple[str, str]] = []  # (path, what happened)
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_rule(self, path: str, action: str, count: int = 1) -> None:
        with self._lock:
            self.rules.append(Rule(path, action, count))

    def fired(self, path: str) -> list[str]:
        with self._lock:
            return [what for p, what in self.events if p == path]

    def _take(self, path: str) -> str:
        with self._lock:
            for rule in self.rules:
                if rule.count > 0 and path == rule.path:
                    rule.count -= 1
                    self.events.append((path, rule.action))
                    return rule.action
            self.events.append((path, "forward"))
            return "forward"

    def __enter__(self) -> FaultProxy:
        self._thread.start()

        async def _start() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        asyncio.run_coroutine_threadsafe(_start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def _stop() -> None:
            assert self._server is not None
            self._server.close()

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                path = head.split(b" ", 2)[1].decode()
                body = await reader.readexactly(content_length(head))
                action = self._take(path)
                if action == "503":
                    msg = b'{"detail":"injected 503"}'
                    writer.write(
                        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                        b"content-length: " + str(len(msg)).encode() + b"\r\n\r\n" + msg
                    )
                    await writer.drain()
                    continue
                if action == "reset_before":
                    writer.transport.abort()
                    return
                response = await forward_once(self.upstream, head, body)
                if action == "reset_after":
                    writer.transport.abort()
                    return
                writer.write(response)
                await writer.drain()
        finally:
            writer.close()
