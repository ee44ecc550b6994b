"""HTTP to the server: one asyncio loop in a daemon thread, retries, and future long-polls.

Every network call of the SDK runs on this loop, so a training loop's thread never blocks on
I/O until it asks for a result, and hundreds of requests can be in flight at once.

Retries never execute anything twice: a submit is re-sent with the same body (the same
`seq_id`), and the server recognises `(model_id, seq_id)` or `(sampling_session_id, seq_id)`
and answers with the request it already has.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from treadle.client.errors import APIConnectionError, RequestFailedError, status_error

log = logging.getLogger("treadle.client")
T = TypeVar("T")

PROTOBUF = "application/x-protobuf"
SDK_VERSION = "0.38.0"  # the Tinker protocol version we speak
# The server holds a retrieve_future for at most 30 s before answering try_again.
POLL_TIMEOUT_S = 45.0


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


def should_retry(resp: httpx.Response) -> bool:
    """A transient status, unless the server says asking again cannot help (a 429 for a
    quota that time does not clear, such as the LoRA rank, says `x-should-retry: false`);
    a 429 of a rate quota carries Retry-After, which the backoff honours."""
    if resp.headers.get("x-should-retry") == "false":
        return False
    return is_transient(resp.status_code)


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _body(resp: httpx.Response) -> Any:
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
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="treadle-io", daemon=True
        )
        self._thread.start()
        self._tasks: set[asyncio.Task] = set()  # strong refs: the loop keeps only weak ones
        # Each sample in flight holds one connection for its long-poll; past this many, new
        # samples wait in the client rather than exhaust the server's sockets.
        self.sample_slots = asyncio.Semaphore(max_in_flight_samples)
        self._closed = False
        headers = {"User-Agent": f"treadle/{SDK_VERSION}", "x-sdk-version": SDK_VERSION}
        if api_key:
            headers["X-API-Key"] = api_key

        async def _make() -> httpx.AsyncClient:
            # Long-polls hold one connection each, so the pool must not cap them.
            return httpx.AsyncClient(
                base_url=self.base_url,
                headers=headers,
                timeout=httpx.Timeout(timeout_s, connect=10.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            )

        self._client: httpx.AsyncClient = self.call(_make())

    # ---- running work on the loop --------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule a coroutine on the background loop; safe from any thread."""
        if self._closed:
            coro.close()
            raise RuntimeError("this client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

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
    ) -> httpx.Response:
        """One HTTP call, retried on transient failures (for `deadline_s`, default the
        policy's); raises a typed error on the rest."""
        deadline = self.retry.deadline_s if deadline_s is None else deadline_s
        start = time.monotonic()
        attempt = 0
        kwargs: dict[str, Any] = {"headers": headers}
        if content is not None:
            kwargs["content"] = content
        elif json is not None:
            kwargs["json"] = json
        if timeout is not None:
            kwargs["timeout"] = timeout
        while True:
            try:
                resp = await self._client.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if not retry or time.monotonic() - start > deadline:
                    raise APIConnectionError(f"{method} {path} failed: {exc!r}") from exc
                log.info("%s %s: %r, retrying", method, path, exc)
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
        body = {"request_id": request_id, "allow_metadata_only": False}
        last_progress = time.monotonic()
        attempt = 0
        iteration = 0
        while True:
            headers["X-Tinker-Request-Iteration"] = str(iteration)
            iteration += 1
            try:
                resp = await self._client.post(
                    "/api/v1/retrieve_future", json=body, headers=headers, timeout=POLL_TIMEOUT_S
                )
            except httpx.TransportError as exc:
                if time.monotonic() - last_progress > self.retry.deadline_s:
                    raise APIConnectionError(f"retrieve_future {request_id}: {exc!r}") from exc
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
        if self._closed:
            return

        async def _shutdown() -> None:
            # Every other task on the loop is a request of ours: cancel them so that their
            # futures end (cancelled) instead of hanging, then close the pool.
            me = asyncio.current_task()
            others = [t for t in asyncio.all_tasks() if t is not me]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            await self._client.aclose()

        if threading.current_thread() is not self._thread:
            try:
                self.call(_shutdown(), timeout=10)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
