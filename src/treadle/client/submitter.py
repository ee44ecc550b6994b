"""The background submitter that keeps one TrainingClient's operations in order.

Invariant: the ops of one model are POSTed in the order they were called, each with the next
`seq_id`; op N+1 is sent once op N's POST has returned its request id. Results are then
waited for concurrently, so a forward_backward and the optim_step after it are both on the
server before the loop waits for either. The server executes them in `seq_id` order.

A seq_id, once reserved, is always sent: an op whose body cannot be built (a custom loss that
raised) sends a harmless stand-in instead, because the server would otherwise wait for the
gap forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from treadle.client.futures import APIFuture
from treadle.client.transport import PROTOBUF, Transport


@dataclass
class Submission:
    """One POST: a JSON body (dict or pydantic model) or protobuf bytes."""

    path: str
    body: Any
    request_type: str


@dataclass
class Job:
    """Ops reserved together; `build` makes their POSTs, `finish` turns raw results into T."""

    build: Callable[[], Awaitable[list[Submission]]]
    finish: Callable[[list[bytes | dict]], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class OrderedSubmitter:
    def __init__(self, transport: Transport, first_seq_id: int = 1):
        self._transport = transport
        # Reentrant: a caller may hold it across two enqueues to get adjacent ids.
        self.lock = threading.RLock()
        self._next_seq_id = first_seq_id
        self._queue: asyncio.Queue[Job | None] = asyncio.Queue()
        self._pending: set[concurrent.futures.Future] = set()
        self._worker = transport.submit(self._run())

    def enqueue(
        self,
        n_seq_ids: int,
        make_job: Callable[[range], Job],
    ) -> APIFuture:
        """Reserve `n_seq_ids` consecutive ids and queue the job built for them."""
        with self.lock:  # reserve and queue atomically, so ids and queue order agree
            ids = range(self._next_seq_id, self._next_seq_id + n_seq_ids)
            job = make_job(ids)  # may raise (a body that cannot be encoded): no id is spent
            self._next_seq_id += n_seq_ids
            self._pending.add(job.future)
            job.future.add_done_callback(self._pending.discard)
            self._transport.loop.call_soon_threadsafe(self._queue.put_nowait, job)
        return APIFuture(job.future)

    def pending(self) -> list[concurrent.futures.Future]:
        with self.lock:
            return list(self._pending)

    def close(self) -> None:
        """Stop taking ops (those queued are still sent)."""
        self._transport.loop.call_soon_threadsafe(self._queue.put_nowait, None)

    # ---- on the loop ---------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._serve()
        finally:
            # closed or cancelled: jobs still queued will never be sent
            while not self._queue.empty():
                job = self._queue.get_nowait()
                if job is not None:
                    job.future.cancel()

    async def _serve(self) -> None:
        while True:
            job = await self._queue.get()
            if job is None:
                return
            try:
                subs = await job.build()
                request_ids = await post_all(self._transport, subs)
            except BaseException as exc:  # noqa: BLE001 - the error belongs to the job's waiter
                _fail(job.future, exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            self._transport.spawn(_finish(self._transport, job, subs, request_ids))


async def post_one(transport: Transport, sub: Submission) -> str:
    if isinstance(sub.body, bytes):
        resp = await transport.request(
            "POST", sub.path, content=sub.body, headers={"Content-Type": PROTOBUF}
        )
        reply = resp.json()
    else:
        reply = await transport.post(sub.path, sub.body)
    return str(reply["request_id"])


async def post_all(transport: Transport, subs: Sequence[Submission]) -> list[str]:
    """POST the chunks of one op; the first goes last so the server sees them all at once."""
    if len(subs) == 1:
        return [await post_one(transport, subs[0])]
    rest = await asyncio.gather(*(post_one(transport, s) for s in subs[1:]))
    first = await post_one(transport, subs[0])
    return [first, *rest]


async def _finish(
    transport: Transport, job: Job, subs: list[Submission], request_ids: list[str]
) -> None:
    try:
        pairs = zip(request_ids, subs, strict=True)
        waits = [transport.wait_result(rid, s.request_type) for rid, s in pairs]
        # one op, one poll: awaited here, without gather's task around it
        raw = [await waits[0]] if len(waits) == 1 else await asyncio.gather(*waits)
        result = job.finish(list(raw))
    except BaseException as exc:  # noqa: BLE001
        _fail(job.future, exc)
        if isinstance(exc, asyncio.CancelledError):
            raise
        return
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled by its waiter
        job.future.set_result(result)


def _fail(future: concurrent.futures.Future, exc: BaseException) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if isinstance(exc, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(exc)
