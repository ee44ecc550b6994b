"""The continuous decode batch of a worker group: each rank decodes a share of the rows.

Rank 0's `DistributedEngine.decode_batch()` is a `GroupDecodeBatch`, what the worker's
executor keeps between rounds as it keeps one process's DecodeBatch (treadle.engine.sample):
the same calls (`add`, `step`, `drop`, `has_results`, `adapter_keys`, `rows`, `len`), which rank 0
tells the other ranks (treadle.engine.distributed), so that every rank runs each of them:

- add: every rank checks every request (they refuse alike); rank 0 places each request
  whole on one rank (the least loaded, by num_samples x (prompt + max_tokens) still to
  decode), every rank prefills its own in its own DecodeBatch (`prepare`), and only once
  every rank has succeeded do they all `commit` them: a failure on any rank raises on every
  rank and leaves every rank's batch as it was;
- step: a loop of group steps. In each, every rank decodes one token for each of its rows
  (its DecodeBatch's own step: join, compaction and per-row adapters as in one process), then
  rank 0 gathers what each rank has to say (finished results, streamed tokens, its rows and
  the adapters they are routed to, whether it failed), hands the streamed tokens to
  `on_tokens`, asks `until()` and tells every rank whether to step again. So every rank stops
  after the same step, and a failure on any rank raises on every rank (a device fault as
  an AcceleratorError naming the rank: treadle.engine.comm.raise_failures).

A row's tokens depend only on its own request (its seed, adapter, settings), never on its
batch: the same tokens as one process, on whichever rank the request lands. Under FSDP every
model call is a collective: the prefills of an add run in `lockstep` (treadle.engine.
dist_sample), and in each group step every rank makes exactly one model call (one token of
the base model when its own rows needed none).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from treadle.engine.dist_sample import lockstep
from treadle.engine.sample import DecodeBatch, StreamedToken
from treadle.engine.sample_utils import validate_request
from treadle.engine.types import SampleRequest, SampleResult

GO, STOP, FAILED = 0, 1, 2  # what rank 0 tells every rank after each group step


@dataclass
class Report:
    """What a rank has to say after a group step (handles are the group's)."""

    results: list[tuple[int, SampleResult]] = field(default_factory=list)
    tokens: list[StreamedToken] = field(default_factory=list)
    rows: int = 0
    keys: set[str] | None = None  # the adapters its rows are routed to, when they changed
    failed: bool = False


class RankShare:
    """This rank's rows of the group's decode batch: a DecodeBatch on its own engine, and
    the group's handle of each of its requests. Every rank has one; rank 0's is inside
    its GroupDecodeBatch."""

    def __init__(self, engine: Any, comm: Any):
        self.engine, self.comm = engine, comm
        self.batch = DecodeBatch(engine)
        self.group_handle: dict[int, int] = {}  # local DecodeBatch handle → the group's
        self._keys: set[str] = set()
        self._tokens: list[StreamedToken] = []
        self._calls = 0  # model calls (FSDP: every rank makes one per group step)

    def add(
        self,
        requests: list[SampleRequest],
        stream: list[bool],
        ranks: list[int],
        handles: list[int],
    ) -> None:
        """Every rank: prefill the requests placed on this rank (`ranks[i]`), and commit
        them once every rank has prefilled its own."""
        for i, req in enumerate(requests):
            validate_request(self.engine, req, i)
        mine = [i for i, r in enumerate(ranks) if r == self.comm.rank]
        admission, failure = None, None
        with lockstep(self.engine, self.comm) if self.comm.fsdp else contextlib.nullcontext():
            try:
                if mine:
                    admission = self.batch.prepare(
                        [requests[i] for i in mine], [stream[i] for i in mine]
                    )
            except Exception as e:  # noqa: BLE001 - every rank hears of it below
                failure = e
        self.comm.raise_failures(failure)
        if admission is not None:
            local = self.batch.commit(admission)
            self.group_handle.update(zip(local, [handles[i] for i in mine], strict=True))

    def drop(self, handles: set[int]) -> dict[int, int] | None:
        """Every rank: stop decoding these requests (the group's handles) where they are;
        → rank 0: tokens each had sampled, gathered from the rank it was on."""
        local = {h for h, g in self.group_handle.items() if g in handles}
        sampled = {self.group_handle.pop(h): n for h, n in self.batch.drop(local).items()}
        gathered = self.comm.gather(sampled)
        if gathered is None:
            return None
        return {h: n for part in gathered for h, n in part.items()}

    def run_steps(self, decide: Callable[[list[Report]], int] | None = None) -> None:
        """Group steps until rank 0 says stop (`decide`, rank 0's: what the gathered reports
        make of it; GO, STOP or FAILED)."""
        hook = None
        if self.comm.fsdp:
            hook = self.engine.model.register_forward_pre_hook(self._count)
        try:
            with self.batch.decoding(self._tokens.extend) as one_step:
                while True:
                    failure: BaseException | None = None
                    calls = self._calls
                    try:
                        report = self._step(one_step)
                    except Exception as e:  # noqa: BLE001 - every rank hears of it below
                        failure, report = e, Report(failed=True)
                    if self.comm.fsdp and self._calls == calls:
                        self._idle_call()  # even after a failure: the others are in theirs
                    gathered = self.comm.gather(report)
                    code = GO
                    if gathered is not None:  # rank 0
                        try:
                            code = decide(gathered) if decide is not None else STOP
                        except Exception as e:  # noqa: BLE001 - e.g. on_tokens: as a failure
                            failure, code = e, FAILED
                    code = self.comm.decide(code)
                    if code == FAILED:
                        self.comm.raise_failures(failure)
                    if code != GO:
                        return
        finally:
            if hook is not None:
                hook.remove()

    def _step(self, one_step: Callable[[], bool]) -> Report:
        """One token for each of this rank's rows → its report."""
        self._tokens.clear()
        one_step()
        of = self.group_handle
        tokens = [(of[h], j, pos, tok, lp) for h, j, pos, tok, lp in self._tokens]
        results = [(of.pop(h), r) for h, r in self.batch.take_results()]
        keys = self.batch.adapter_keys()
        changed = keys != self._keys
        self._keys = keys
        return Report(results, tokens, self.batch.rows, keys if changed else None)

    def _count(self, module: torch.nn.Module, args: Any) -> None:
        self._calls += 1

    def _idle_call(self) -> None:
        """One base token: this rank's part of the group step's FSDP collectives."""
        one = torch.zeros((1, 1), dtype=torch.long, device=self.engine.device)  # (1, 1)
        with torch.inference_mode(), self.engine.bank.rows([None]):
            self.engine.model(input_ids=one, use_cache=False, logits_to_keep=1)


class GroupDecodeBatch:
    """Rank 0's handle on the group's decode batch: the DecodeBatch interface the worker's
    executor uses. Only the engine's thread may call it."""

    def __init__(self, engine: Any, share: RankShare):
        self._engine = engine  # the DistributedEngine: its lock, its calls to the ranks
        self._share = share
        self._world = share.comm.world
        self._handles = itertools.count()
        self._open: dict[int, tuple[int, int]] = {}  # handle → (rank, cost), until handed back
        self._ready: list[tuple[int, SampleResult]] = []
        self._rows = [0] * self._world  # as each rank last reported
        self._keys: list[set[str]] = [set() for _ in range(self._world)]
        self._failed = False

    def __len__(self) -> int:
        """Requests added whose results step() has not handed back yet."""
        return len(self._open)

    @property
    def rows(self) -> int:
        """Decode rows held on all ranks (as of the last step)."""
        return sum(self._rows)

    @property
    def has_results(self) -> bool:
        return bool(self._ready)

    def adapter_keys(self) -> set[str]:
        """The adapters and snapshots that rows on some rank are routed to, as each rank
        last reported (none of them may be freed; the rows of requests added since are
        held by their own ops until they end)."""
        return set().union(*self._keys)

    def add(self, requests: list[SampleRequest], stream: list[bool] | None = None) -> list[int]:
        """As DecodeBatch.add, over the group: → a handle per request."""
        self._usable()
        for i, req in enumerate(requests):
            validate_request(self._share.engine, req, i)  # a refusal costs the ranks nothing
        stream = list(stream) if stream is not None else [False] * len(requests)
        handles = [next(self._handles) for _ in requests]
        ranks = self._place(requests)
        with self._engine._lock:
            self._engine._tell("decode_add", (requests, stream, ranks, handles))
            self._engine._collective(self._share.add, requests, stream, ranks, handles)
        for h, rank, req in zip(handles, ranks, requests, strict=True):
            self._open[h] = (rank, _cost(req))
        return handles

    def step(
        self,
        max_steps: int = 2**31,
        until: Callable[[], bool] | None = None,
        on_tokens: Callable[[list[StreamedToken]], None] | None = None,
    ) -> list[tuple[int, SampleResult]]:
        """As DecodeBatch.step, over the group; a step that fails on any rank raises (on
        every rank) and leaves the batch unusable: drop it."""
        self._usable()
        steps = 0

        def decide(reports: list[Report]) -> int:
            nonlocal steps
            steps += 1
            if any(r.failed for r in reports):
                return FAILED
            tokens: list[StreamedToken] = []
            for rank, r in enumerate(reports):
                self._ready += r.results
                tokens += r.tokens
                self._rows[rank] = r.rows
                if r.keys is not None:
                    self._keys[rank] = r.keys
            for h, _ in itertools.chain(*(r.results for r in reports)):
                self._open[h] = (self._open[h][0], 0)  # no load left
            if tokens and on_tokens is not None:
                on_tokens(tokens)
            if steps >= max_steps or not any(self._rows):
                return STOP
            return STOP if until is not None and until() else GO

        try:
            with self._engine._lock:
                self._engine._tell("decode_step", ())
                self._engine._collective(self._share.run_steps, decide)
        except BaseException:
            self._failed = True
            raise
        out, self._ready = self._ready, []
        for h, _ in out:
            del self._open[h]
        return out

    def drop(self, handles: set[int]) -> dict[int, int]:
        """As DecodeBatch.drop, over the group: these requests leave the batch (between two
        group steps) on whichever rank each is; → tokens each had sampled."""
        handles = handles & self._open.keys()
        if not handles:
            return {}
        with self._engine._lock:
            self._engine._tell("decode_drop", (handles,))
            sampled = self._engine._collective(self._share.drop, handles)
        for h in handles:
            del self._open[h]
        self._ready = [(h, r) for h, r in self._ready if h not in handles]
        return sampled or {}

    def _usable(self) -> None:
        if self._failed:
            raise RuntimeError("a step of this decode batch failed: it is unusable")

    def _place(self, requests: list[SampleRequest]) -> list[int]:
        """The rank of each request: the least loaded one as they come."""
        load = [0] * self._world
        for rank, cost in self._open.values():
            load[rank] += cost
        ranks = []
        for req in requests:
            rank = min(range(self._world), key=load.__getitem__)
            load[rank] += _cost(req)
            ranks.append(rank)
        return ranks


def _cost(req: SampleRequest) -> int:
    return req.num_samples * (len(req.prompt) + req.params.max_tokens)
