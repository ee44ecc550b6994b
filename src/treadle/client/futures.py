"""APIFuture: the handle every accelerator-bound call returns at once.

It wraps a `concurrent.futures.Future` that the SDK's background loop completes, so the same
object works from plain threads (`.result(timeout)`) and from asyncio code (`await fut`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class APIFuture(Generic[T]):
    """The eventual result of one call; wait with `.result(timeout)` or `await`."""

    def __init__(
        self,
        future: concurrent.futures.Future[T] | None = None,
        on_cancel: Callable[[], Any] | None = None,
    ):
        self._future: concurrent.futures.Future[T] = future or concurrent.futures.Future()
        self._on_cancel = on_cancel  # tells the server (a sample's cancel_future)

    def cancel(self) -> bool:
        """Stop the call: a sample's op leaves the server's queue, or its decode batch at
        the next step (metered for what it sampled), and this future ends cancelled.
        → False when it had already finished (nothing to stop)."""
        if self._future.done():
            return False
        if self._on_cancel is not None:
            self._on_cancel()
        return self._future.cancel() or self._future.cancelled()

    @classmethod
    def completed(cls, value: T) -> APIFuture[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        fut.set_result(value)
        return cls(fut)

    def result(self, timeout: float | None = None) -> T:
        """Block until the result is ready; raises the request's error, or TimeoutError."""
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[APIFuture[T]], Any]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def future(self) -> concurrent.futures.Future[T]:
        """The underlying concurrent future (for `concurrent.futures.wait` and friends)."""
        return self._future

    async def result_async(self, timeout: float | None = None) -> T:
        # wrap_future hooks the result into the caller's own running loop.
        return await asyncio.wait_for(asyncio.wrap_future(self._future), timeout)

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self._future).__await__()

    def map(self, fn: Callable[[T], U]) -> APIFuture[U]:
        """A future of `fn(result)`; errors pass through unchanged."""
        out: concurrent.futures.Future[U] = concurrent.futures.Future()

        def _done(src: concurrent.futures.Future[T]) -> None:
            try:
                out.set_result(fn(src.result()))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                out.set_exception(exc)

        self._future.add_done_callback(_done)
        return APIFuture(out)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<APIFuture {state}>"
