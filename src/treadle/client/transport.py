"""HTTP to the server: one asyncio loop in a daemon thread, retries, and future long-polls.

Every network call of the SDK runs on this loop, so a training loop's thread never blocks on
I/O until it asks for a result, and hundreds of requests can be in flight at once.

The client is aiohttp: a round trip on loopback costs half of httpx's (0.46 vs 0.97 ms for
a bare GET through the loop's thread), and a minimal call makes two (the submit, the poll).
A reply is read whole and handed on as a `Reply` (status, headers, body), so no connection
stays checked out by a caller.

Retries never execute anything twice: a submit is re-sent with the same body (the same
`seq_id`), and the server recognises `(model_id, seq_id)` or `(sampling_session_id, seq_id)`
and answers with the request it already has.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json as jsonlib
import logging
import random
import threading
import time
import weakref
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from yarl import URL

from treadle.client.errors import APIConnectionError, RequestFailedError, status_error

log = logging.getLogger("treadle.client")
T = TypeVar("T")

PROTOBUF = "application/x-protobuf"
SDK_VERSION = "0.38.0"  # the Tinker protocol version we speak
# The server holds a retrieve_future for at most 30 s before answering try_again.
POLL_TIMEOUT_S = 45.0
# Idle connections are closed before the server's keep-alive (75 s) would close them.
KEEPALIVE_S = 60.0
# What a request can fail with short of an HTTP status that is worth retrying, like a 5xx
# (refused, reset, cut off mid-body, timed out); other client errors (a malformed URL) are not.
TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)


@dataclass(frozen=True)
class Reply:
    """One HTTP response, read whole."""

    status_code: int
    headers: Mapping[str, str]  # case-insensitive
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return jsonlib.loads(self.content)


@dataclass
class RetryPolicy:
    """Backoff for transient failures: connection errors, 408, 429 and 5xx. A quota's 429
    (requests per minute, a session or adapter slot) is retried after its Retry-After, so a
    loop's calls are delayed, never lost.

    Retrying stops once `deadline_s` has passed since the call started (or since the server
    last made progress, for long-polls); the last error is raised then.
    """

    initial_backoff_s: float = 0.05
    max_backoff_s: float = 5.0
    deadline_s: float = 120.0

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_backoff_s * 6)
        base = min(self.initial_backoff_s * 2**attempt, self.max_backoff_s)
        return base * (0.5 + random.random() / 2)  # jitter keeps many clients apart


def is_transient(status_code: int) -> bool:
    return status_code in (408, 429) or status_code >= 500


def _timeout(seconds: float) -> aiohttp.ClientTimeout:
    """A limit on each wait for the server (to connect, then each read), never on the whole
    call: a large download takes as long as it streams."""
    return aiohttp.ClientTimeout(total=None, connect=min(10.0, seconds), sock_read=seconds)


def as_json(body: Any, headers: dict[str, str] | None) -> tuple[bytes, dict[str, str]]:
    """A JSON body and the headers that say so."""
    return jsonlib.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}


def _said(exc: BaseException) -> str:
    """A transport error in one line: its class and message (aiohttp's reprs run long)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def should_retry(resp: Reply) -> bool:
    """A transient status, unless the server says asking again cannot help (a 429 for a
    quota that time does not clear, such as the LoRA rank, says `x-should-retry: false`);
    a 429 of a rate quota carries Retry-After, which the backoff honours."""
    if resp.headers.get("x-should-retry") == "false":
        return False
    return is_transient(resp.status_code)


def _retry_after(resp: Reply) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _body(resp: Reply) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None


class Transport:
    """The connection pool and the background loop shared by one ServiceClient's clients."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        retry: RetryPolicy | None = None,
        timeout_s: float = 120.0,
        max_in_flight_samples: int = 512,
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.retry = retry or RetryPolicy()
        self._loop = asyncio.new_event_loop()
        # Strong refs to our tasks (the loop keeps only weak ones), held by the running
        # thread: a task waiting on a queue of a client dropped unclosed is not collected
        # mid-wait ("Task was destroyed but it is pending!"); close() or exit ends it.
        self._tasks: set[asyncio.Task] = set()
        self._thread = threading.Thread(
            target=_run_loop, args=(self._loop, self._tasks), name="treadle-io", daemon=True
        )
        self._thread.start()
        # Each sample in flight holds one connection for its long-poll; past this many, new
        # samples wait in the client rather than exhaust the server's sockets.
        self.sample_slots = asyncio.Semaphore(max_in_flight_samples)
        self._closed = False
        # sent with every request; ServiceClient adds its encryption key here
        self.headers: dict[str, str] = {
            "User-Agent": f"treadle/{SDK_VERSION}",
            "x-sdk-version": SDK_VERSION,
        }
        if api_key:
            self.headers["X-API-Key"] = api_key
        self._timeout = _timeout(timeout_s)

        async def _make() -> aiohttp.ClientSession:
            # Long-polls hold one connection each, so the pool must not cap them.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
            return aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar(), timeout=self._timeout
            )

        self._client: aiohttp.ClientSession = self.call(_make())
        # runs once: at close(), when collected unclosed, or at exit (_release_all)
        self._release = weakref.finalize(self, _release, self._loop, self._thread, self._client)
        self._release.atexit = False
        _open.add(self)

    # ---- running work on the loop --------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule a coroutine on the background loop; safe from any thread."""
        if self._closed:
            coro.close()
            raise RuntimeError("this client is closed")
        return asyncio.run_coroutine_threadsafe(self._kept(coro), self._loop)

    async def _kept(self, coro: Coroutine[Any, Any, T]) -> T:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            return await coro
        finally:
            self._tasks.discard(task)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for it (for direct, synchronous calls)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking SDK call made from inside the SDK's own loop")
        return self.submit(coro).result(timeout)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Start a task from inside the loop and keep a reference until it ends."""
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- requests ------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        retry: bool = True,
        timeout: float | None = None,
        deadline_s: float | None = None,
    ) -> Reply:
        """One HTTP call, retried on transient failures (for `deadline_s`, default the
        policy's); raises a typed error on the rest."""
        deadline = self.retry.deadline_s if deadline_s is None else deadline_s
        start = time.monotonic()
        attempt = 0
        if content is None and json is not None:
            content, headers = as_json(json, headers)
        while True:
            try:
                resp = await self.send(method, path, content, headers, timeout)
            except aiohttp.InvalidURL as exc:
                raise APIConnectionError(f"{method} {path}: invalid URL: {exc}") from exc
            except TRANSPORT_ERRORS as exc:
                if not retry or time.monotonic() - start > deadline:
                    raise APIConnectionError(f"{method} {path} failed: {_said(exc)}") from exc
                log.info("%s %s: %s, retrying", method, path, _said(exc))
                await asyncio.sleep(self.retry.backoff(attempt))
                attempt += 1
                continue
            if resp.status_code < 400:
                return resp
            if retry and should_retry(resp):
                if time.monotonic() - start <= deadline:
                    log.info("%s %s: HTTP %d, retrying", method, path, resp.status_code)
                    await asyncio.sleep(self.retry.backoff(attempt, _retry_after(resp)))
                    attempt += 1
                    continue
            raise status_error(resp.status_code, _body(resp), resp.text)

    async def send(
        self,
        method: str,
        path: str,
        content: bytes | None,
        headers: dict[str, str] | None,
        timeout: float | None = None,
    ) -> Reply:
        """One attempt: the reply read whole, whatever its status."""
        async with self._client.request(
            method,
            URL(self.base_url + path, encoded=True),  # paths come quoted already: sent as is
            data=content,
            headers={**self.headers, **(headers or {})},
            timeout=self._timeout if timeout is None else _timeout(timeout),
        ) as resp:
            body = await resp.read()
            return Reply(resp.status, resp.headers, body)

    async def post(self, path: str, body: Any, **kw: Any) -> Any:
        """POST a JSON body (a dict or a pydantic model); return the JSON reply."""
        if hasattr(body, "model_dump"):
            body = body.model_dump(mode="json", exclude_none=True)
        resp = await self.request("POST", path, json=body, **kw)
        return resp.json()

    async def get(self, path: str, **kw: Any) -> Any:
        return (await self.request("GET", path, **kw)).json()

    async def wait_result(self, request_id: str, request_type: str) -> bytes | dict:
        """Long-poll `retrieve_future` until the result is there.

        Returns the protobuf bytes or the JSON dict; raises RequestFailedError when the
        server reports the request failed, and a typed error for a fatal HTTP status.
        """
        headers = {"X-Tinker-Request-Type": request_type}
        if request_type in ("Forward", "ForwardBackward", "Sample"):
            headers["Accept"] = PROTOBUF
        content, headers = as_json(
            {"request_id": request_id, "allow_metadata_only": False}, headers
        )
        last_progress = time.monotonic()
        attempt = 0
        iteration = 0
        while True:
            headers["X-Tinker-Request-Iteration"] = str(iteration)
            iteration += 1
            try:
                resp = await self.send(
                    "POST", "/api/v1/retrieve_future", content, headers, POLL_TIMEOUT_S
                )
            except TRANSPORT_ERRORS as exc:
                if time.monotonic() - last_progress > self.retry.deadline_s:
                    raise APIConnectionError(f"retrieve_future {request_id}: {_said(exc)}") from exc
                await asyncio.sleep(self.retry.backoff(attempt))
                attempt += 1
                continue
            status = resp.status_code
            if status == 200 and PROTOBUF in resp.headers.get("content-type", ""):
                return resp.content
            reply = _body(resp)
            if status in (200, 408) and isinstance(reply, dict):
                if reply.get("type") == "try_again":
                    # The server held the poll and the request is still queued: ask again.
                    last_progress = time.monotonic()
                    attempt = 0
                    continue
            if status == 200:
                if isinstance(reply, dict) and "error" in reply:
                    raise RequestFailedError(
                        str(reply["error"]), request_id, str(reply.get("category", "unknown"))
                    )
                return reply
            if should_retry(resp) and time.monotonic() - last_progress <= self.retry.deadline_s:
                await asyncio.sleep(self.retry.backoff(attempt, _retry_after(resp)))
                attempt += 1
                continue
            raise status_error(status, reply, resp.text)

    # ---- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Close the pool and stop the loop; pending futures are cancelled."""
        if not self._closed:
            self._closed = True
            _release_now(self)


def _run_loop(loop: asyncio.AbstractEventLoop, tasks: set[asyncio.Task]) -> None:
    """The I/O thread: `tasks` is held (as this thread's argument) while the loop runs."""
    loop.run_forever()


def _release(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread, session: aiohttp.ClientSession
) -> None:
    """Close a transport's pool and stop its loop: from close(), or for a transport collected
    (or still open at exit) without one, so that neither its thread nor its sockets leak.
    Its tasks (requests, a session's heartbeat, a submitter) are cancelled first, so that
    their futures end (cancelled) instead of hanging, and the loop is closed once its thread
    has ended: nothing is left for asyncio or aiohttp to warn about at exit (an unfinished
    session then expires on the server)."""
    if loop.is_closed() or not loop.is_running():
        return

    async def shutdown() -> None:
        try:
            me = asyncio.current_task()
            others = [t for t in asyncio.all_tasks() if t is not me]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            await session.close()
        finally:
            loop.call_soon(loop.stop)  # after this task's result reaches the caller

    done = asyncio.run_coroutine_threadsafe(shutdown(), loop)
    if threading.current_thread() is thread:  # on the loop itself it cannot be waited for
        return
    with contextlib.suppress(Exception):
        done.result(5)
    thread.join(5)
    if not thread.is_alive():
        loop.close()


_open: weakref.WeakSet[Transport] = weakref.WeakSet()


def _release_now(transport: Transport) -> None:
    """Run a transport's release once, now. Detached, not called: at interpreter exit,
    weakref's own exit hook (registered at the first finalize, so run before ours and the
    ServiceClient's) has switched every finalize off, and calling one then does nothing
    but forget it: the pool was left open, and aiohttp warned of it when it was collected."""
    if (detached := transport._release.detach()) is not None:
        _, func, args, _ = detached
        func(*args)


@atexit.register  # at import: it runs after the exit hooks of the modules that import this
def _release_all() -> None:
    for transport in list(_open):
        _release_now(transport)
