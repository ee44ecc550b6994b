"""Engines another API process runs: what a frontend holds of the engine host's models.

Several `treadle serve` processes may share one PostgreSQL database. One of them, the
engine host, runs the engines (its workers connect to it); the others, frontends
(`--engine-host false`), hold one ForwardEngine per served model. A ForwardEngine is an
EngineClient whose ops reach the engine through their request rows: the transaction that
files a request also notifies the host (treadle.server.core.futures, treadle.server.storage.
notify), which loads the row and submits the op to its own engine (treadle.server.core.
shared); results come back the same way. Its control calls (load a sampler from a checkpoint,
drop one, check an adapter) are rows of control_calls, awaited until the host has answered
(`ControlCalls`). The facts requests are checked against come from the row the host wrote
when its engines were up (served_models).

What a frontend cannot know, it leaves to the host: whether a seq_id was used (the host
checks it when it takes the op; a resubmission is recognised by its dedup key at filing, as
everywhere), and whether a sampler's weights are still in memory.

`Claims` is the engine host's record of the requests handed to its engines, so that a
request reached both by a notification and by a scan (recovery, a reconnect) runs once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections import OrderedDict
from typing import Any

from sqlalchemy import Connection

from treadle.engine.types import SampledSeq, SampleResult
from treadle.errors import EngineDeadError, ErrorInfo, NotFoundError
from treadle.server.runtime.engine_client import EngineClient, EngineFacts
from treadle.server.runtime.journal import Journal
from treadle.server.runtime.ops import Op
from treadle.server.storage.notify import Notify
from treadle.server.storage.queries import call_answer, insert_call
from treadle.server.storage.rows import new_id
from treadle.wire import codec

log = logging.getLogger("treadle.forward")

# Request ids remembered as handed to an engine; an older one is long finished, and a late
# notification of it finds its row no longer pending.
MAX_CLAIMS = 200_000
# Control calls the engine host runs for other processes.
CONTROL_CALLS = ("load_sampler", "drop_ref", "check_adapter")


class Claims:
    """Request ids handed to this process's engines (any thread)."""

    def __init__(self, max_kept: int = MAX_CLAIMS):
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self.max_kept = max_kept

    def take(self, request_id: str) -> bool:
        """True the first time a request id is taken: the caller submits it."""
        with self._lock:
            if request_id in self._ids:
                return False
            self._ids[request_id] = None
            while len(self._ids) > self.max_kept:
                self._ids.popitem(last=False)
            return True

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._ids


class ControlCalls:
    """This process's control calls for the engine host: a row and a notification, then
    the answer the host writes (`answered`, from the listener)."""

    def __init__(self, journal: Journal, notify: Notify, timeout_s: float):
        self.journal = journal
        self.notify = notify
        self.timeout_s = timeout_s
        self._waiting: dict[str, asyncio.Future[None]] = {}

    async def call(self, base_model: str, name: str, args: dict[str, Any]) -> None:
        call_id = new_id()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = done
        values = {"call_id": call_id, "base_model": base_model, "name": name, "args": args}

        def write(conn: Connection) -> None:
            insert_call(conn, values)
            self.notify.call(conn, call_id)

        try:
            await self.journal.run(write)
            async with asyncio.timeout(self.timeout_s):
                await done
        except TimeoutError:
            raise EngineDeadError(
                f"the engine host did not answer {name} for {base_model!r} within "
                f"{self.timeout_s:.0f} s; retry later"
            ) from None
        finally:
            self._waiting.pop(call_id, None)

    def answered(self, call_ids: list[str]) -> None:
        """Event loop: these calls have answers (those of this process are read)."""
        mine = [c for c in call_ids if c in self._waiting]
        if mine:
            asyncio.get_running_loop().create_task(self._settle(mine))

    def catch_up(self) -> None:
        """After notifications may have been missed: read every awaited call again."""
        self.answered(list(self._waiting))

    async def _settle(self, call_ids: list[str]) -> None:
        def read(conn: Connection) -> dict[str, Any]:
            return {c: call_answer(conn, c) for c in call_ids}

        try:
            answers = await self.journal.run(read)
        except Exception:
            log.exception("reading the answers of control calls")
            return
        for call_id, answer in answers.items():
            done = self._waiting.get(call_id)
            if done is None or done.done() or answer is None:
                continue
            status, error = answer
            if status == "done":
                done.set_result(None)
            else:
                info = ErrorInfo(**error) if error else ErrorInfo("TreadleError", "it failed")
                done.set_exception(info.to_exception())


def error_record(error: BaseException) -> dict[str, str]:
    """A control call's error as its row keeps it (ErrorInfo's fields)."""
    return dataclasses.asdict(ErrorInfo.of(error))


class ForwardEngine(EngineClient):
    """A model the engine host serves, seen from a frontend. Every method runs on the event
    loop but `submit`, which has nothing to do: the filing transaction woke the host."""

    def __init__(self, facts: EngineFacts, calls: ControlCalls):
        self.facts = facts
        self.calls = calls
        self._models: set[str] = set()  # training models this process knows as loaded

    def start(self) -> None:
        pass

    def stop(self, timeout_s: float = 10.0) -> None:
        pass

    def add_model(self, model_id: str, next_seq: int = 0) -> None:
        self._models.add(model_id)

    def has_model(self, model_id: str) -> bool:
        return model_id in self._models

    def check_seq(self, model_id: str, seq_id: int) -> None:
        # the seq_id order lives on the engine host, which refuses a used one when it takes
        # the op; here only whether the model is loaded
        if model_id not in self._models:
            raise NotFoundError(f"model_id {model_id!r} is not loaded on this server")

    def submit(self, op: Op) -> None:
        pass  # the request row and its notification, committed together, are the submission

    def is_live(self, ref: str) -> bool:
        return True  # the engine host answers a sample of freed weights with the same 404

    async def load_sampler(self, ref: str, checkpoint_type: str, directory: str) -> None:
        args = {"ref": ref, "checkpoint_type": checkpoint_type, "directory": directory}
        await self.calls.call(self.name, "load_sampler", args)

    async def drop_ref(self, ref: str) -> None:
        await self.calls.call(self.name, "drop_ref", {"ref": ref})

    async def check_adapter(self, directory: str) -> None:
        await self.calls.call(self.name, "check_adapter", {"directory": directory})

    async def unload_model(self, model_id: str, reason: str) -> None:
        # the engine host frees it when it hears that the model or its session ended
        # (treadle_ended, committed with the row that says so)
        self._models.discard(model_id)

    async def restore_model(
        self, model_id: str, state_dir: str | None, samplers: dict[str, str], next_seq: int
    ) -> None:
        raise RuntimeError("models are restored by the engine host")

    async def snapshot_all(self) -> None:
        pass  # the engine host writes its models' state

    def status(self) -> str:
        return "served by the engine host"


def sample_result(body: bytes) -> SampleResult:
    """A stored sample result (the protobuf SampleResponse) → the engine's SampleResult: what
    an in-process caller of a frontend (the OpenAI routes) gets."""
    resp = codec.decode_sample_response(body)
    sequences = [
        SampledSeq(s.tokens, list(s.logprobs or []), s.stop_reason, s.topk_logprobs)
        for s in resp.sequences
    ]
    target, alt = resp.target_prompt_logprobs, resp.prompt_alt_tokens
    return SampleResult(
        sequences,
        prompt_logprobs=resp.prompt_logprobs,
        topk_prompt_logprobs=resp.topk_prompt_logprobs,
        target_prompt_logprobs=None if target is None else target.to_numpy(),
        prompt_alt_tokens=None if alt is None else (alt[0].to_numpy(), alt[1].to_numpy()),
    )


def facts_of(row: dict[str, Any]) -> EngineFacts:
    """A served_models row → the facts a ForwardEngine checks requests against."""
    fields = {f.name for f in dataclasses.fields(EngineFacts)}
    return EngineFacts(**{k: v for k, v in row.items() if k in fields})


def facts_row(facts: EngineFacts) -> dict[str, Any]:
    return dataclasses.asdict(facts)
