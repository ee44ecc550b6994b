"""Batched sampling with a KV cache, incremental: a DecodeBatch lives across engine calls.

`DecodeBatch(engine)` holds the rows being decoded. `add(requests)` prefills new requests and
joins them to the rows already decoding (continuous batching); `step(...)` decodes one token
per row per step, for as many steps as its caller lets it, and hands back the requests that
finished. Between two calls the engine thread is free for other work (a training step of
another session), and the rows wait in memory. `sample(engine, requests)`, what
`Engine.sample` runs, is one add and steps to the end. One call mixes requests of several
adapters (or snapshots, or the base model), prompt lengths and sampling settings.

`add`, in its phases:
1. plan (`_plan`): one prefill row per distinct (adapter, prompt) some request needs;
   requests that want neither prompt logprobs nor new tokens need no model work at all;
2. score (`_score`): prompts that are only scored (max_tokens 0, compute_logprobs) run
   apart without a cache, in chunks whose logits fit LOGITS_BUDGET;
3. prefill (`_prefill`): the generating prompts, left-padded into one batch, with the
   per-row adapter keys handed to `engine.bank.rows`; prompt logprobs of these rows come out
   of the same pass;
4. expand (`_cohort`): the cache rows are repeated so that the `num_samples` completions of a
   prompt share its single prefill, into buffers sized for the whole decode
   (`sample_utils.preallocate`), one pre-drawn uniform per row and step;
5. join (`treadle.engine.decode.join`): the new rows join the running ones in one cache.

`step`: one token per row per step (`treadle.engine.decode.Cohort`: pick, drop finished rows
once enough of them have finished, forward). A row's tokens depend only on its own prompt,
adapter, settings and seed, never on which rows share its batch or when it joined.

Logprobs reported for sampled tokens are log_softmax of the raw logits in fp32, not of the
temperature / top-k / top-p adjusted distribution: the trainer computes exactly this quantity
for the same tokens, so importance ratios between sampler and trainer are 1 when the weights
are the same.

Here: the DecodeBatch, and the model passes of add (score, prefill); the plan of add is in
sample_plan.py, the building of decode rows in sample_cohort.py.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from treadle.engine.decode import Cohort, cache_arg, join, joinable
from treadle.engine.sample_cohort import _cohort
from treadle.engine.sample_plan import _Plan, _plan
from treadle.engine.sample_prefill import prefill_with_prefixes
from treadle.engine.sample_utils import preallocate, validate_request
from treadle.engine.threads import CallThreads, threads_for
from treadle.engine.types import SampledSeq, SampleRequest, SampleResult

# Scoring prefills are split so that their full (rows, T, V) logits stay under this many
# elements: compute_logprobs over many long prompts must not allocate rows * T * V at once.
LOGITS_BUDGET = 2**27

# What step() reports of streamed rows: (request handle, sample index, position, token, logprob)
StreamedToken = tuple[int, int, int, int, float]


def sample(engine: Any, requests: list[SampleRequest]) -> list[SampleResult]:
    """Run all requests together and return one SampleResult per request, in order.

    `engine` provides model, bank (bank.rows(keys) routes batch rows to adapters), tokenizer,
    eos_token_ids, vocab_size, max_seq_len and device. Raises InvalidRequestError naming the
    field for any invalid request, before any model work.
    """
    batch = DecodeBatch(engine)
    handles = batch.add(requests)
    done: dict[int, SampleResult] = {}
    while len(batch):
        done.update(batch.step())
    return [done[h] for h in handles]


@dataclass
class _Pending:
    """A request some of whose samples are still decoding."""

    result: SampleResult
    seqs: list[SampledSeq | None]
    left: int


class DecodeBatch:
    """The requests being sampled on one engine, kept between engine calls.

    Only the engine's thread may call it. Rows usually share one cohort (one KV cache); a
    model whose cache layers cannot be joined (linear attention) decodes
    its cohorts one after the other instead.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self.cohort: Cohort | None = None
        self.waiting: deque[Cohort] = deque()  # cohorts that could not join the running one
        self._pending: dict[int, _Pending] = {}
        self._ready: list[tuple[int, SampleResult]] = []
        self._handles = itertools.count()

    def __len__(self) -> int:
        """Requests added whose results step() has not handed back yet."""
        return len(self._pending) + len(self._ready)

    @property
    def rows(self) -> int:
        """Decode rows held (finished rows not yet dropped included)."""
        return sum(len(c) for c in (self.cohort, *self.waiting) if c is not None)

    def adapter_keys(self) -> set[str]:
        """The adapters and snapshots that rows are routed to: every decode step routes all
        of a cohort's rows, finished ones too until the cohort drops them, so none of these
        may be freed."""
        cohorts = [c for c in (self.cohort, *self.waiting) if c is not None]
        return {k for c in cohorts for k in c.keys if k is not None}

    @property
    def has_results(self) -> bool:
        """Whether a finished request waits to be handed back by step()."""
        return bool(self._ready)

    # ---- admitting requests ----
    def add(self, requests: list[SampleRequest], stream: list[bool] | None = None) -> list[int]:
        """Prefill requests and join them to the decoding rows: → a handle per request.

        Raises InvalidRequestError naming the field (requests[i].<field>) for any invalid
        request, before any model work; on any error the batch is as it was. `stream[i]` asks for
        request i's tokens as they are sampled (step's on_tokens). Requests that need no new
        tokens (max_tokens 0) are finished at once; step() hands their results back.
        """
        return self.commit(self.prepare(requests, stream))

    def prepare(
        self, requests: list[SampleRequest], stream: list[bool] | None = None
    ) -> _Admission:
        """add's model work (plan, score, prefill, expand, join), which changes nothing of
        the batch: `commit` makes it the batch's (a group commits once every rank's
        prepare succeeded)."""
        engine = self.engine
        for i, req in enumerate(requests):
            validate_request(engine, req, i)
        stream = list(stream) if stream is not None else [False] * len(requests)
        handles = [next(self._handles) for _ in requests]
        results = [SampleResult(sequences=[]) for _ in requests]
        longest = max((len(r.prompt) for r in requests), default=0)
        with torch.inference_mode(), threads_for(len(requests) * longest):  # at most (P, T)
            plan = _plan(requests)
            _score(engine, plan, requests, results)
            cohort = _prefill_and_expand(engine, plan, requests, results, handles, stream)
            plan.fill_prompt_logprobs(requests, results)
            running, waiting = self.cohort, list(self.waiting)
            done: list[tuple[tuple[int, int], SampledSeq]] = []
            if cohort is None:
                pass
            elif cohort.cache is None:
                # every row ends at its first token, which the prefill gives: no decode step
                _, finished, _ = cohort.pick()
                done = list(
                    zip([cohort.owner[b] for b in finished], cohort.seqs(finished), strict=True)
                )
            elif running is None:
                running = cohort
            elif joinable(running) and joinable(cohort):
                running = join(running, cohort)
            else:
                waiting.append(cohort)
        return _Admission(handles, requests, results, running, deque(waiting), done)

    def commit(self, admission: _Admission) -> list[int]:
        """Make a prepared admission the batch's (nothing here fails): → its handles."""
        a = admission
        self.cohort, self.waiting = a.running, a.waiting
        for h, req, res in zip(a.handles, a.requests, a.results, strict=True):
            n = req.num_samples
            if req.params.max_tokens == 0:
                res.sequences = [SampledSeq([], [], "length") for _ in range(n)]
                self._ready.append((h, res))
            else:
                self._pending[h] = _Pending(res, [None] * n, n)
        for owner, seq in a.done:
            self._finished(owner, seq)
        return a.handles

    def drop(self, handles: set[int]) -> dict[int, int]:
        """Stop decoding these requests (cancelled) between two steps: their rows leave the
        batch at once and no result comes back for them; → tokens each had sampled."""
        sampled: dict[int, int] = {}
        with torch.inference_mode():  # the rows' tensors are inference tensors
            for c in [self.cohort, *self.waiting]:
                rows = [b for b, (h, _) in enumerate(c.owner) if h in handles] if c else []
                if not rows:
                    continue
                for b, n in zip(rows, c.step[rows].tolist(), strict=True):
                    sampled[c.owner[b][0]] = sampled.get(c.owner[b][0], 0) + int(n)
                c.done[rows] = True
                keep = (~c.done).nonzero().squeeze(1)  # (n',) the rows that go on
                if len(keep):
                    c.select(keep)
                elif c is self.cohort:
                    self.cohort = None
                else:
                    self.waiting.remove(c)
        for h in handles:
            p = self._pending.pop(h, None)
            if p is not None:  # its samples that had finished already
                sampled[h] = sampled.get(h, 0) + sum(len(q.tokens) for q in p.seqs if q)
        self._ready = [(h, r) for h, r in self._ready if h not in handles]
        return sampled

    # ---- decoding ----
    def step(
        self,
        max_steps: int = 2**31,
        until: Callable[[], bool] | None = None,
        on_tokens: Callable[[list[StreamedToken]], None] | None = None,
    ) -> list[tuple[int, SampleResult]]:
        """Decode up to max_steps tokens per row, stopping early once `until()` (asked after
        every step) is true: → (handle, result) of the requests that finished, including
        those add() finished at once. `on_tokens` hears the tokens of streamed requests
        after every step. A step that fails leaves the batch unusable: drop it.
        """
        with self.decoding(on_tokens) as one_step:
            for _ in range(max_steps):
                if not one_step():
                    break
                if until is not None and until():
                    break
        return self.take_results()

    def take_results(self) -> list[tuple[int, SampleResult]]:
        """The finished requests not handed back yet (and forget them)."""
        out, self._ready = self._ready, []
        return out

    @contextlib.contextmanager
    def decoding(
        self, on_tokens: Callable[[list[StreamedToken]], None] | None = None
    ) -> Iterator[Callable[[], bool]]:
        """A context giving `one_step()`: decode one token per row (→ False, having done
        nothing, when no row is left). The rows stay routed from one step to the next."""
        bank = self.engine.bank
        with torch.inference_mode(), contextlib.ExitStack() as routed, CallThreads() as threads:
            route_for: Cohort | None = None  # the cohort whose keys are routed now

            def one_step() -> bool:
                nonlocal route_for
                if self.cohort is None:
                    if not self.waiting:
                        return False
                    self.cohort = self.waiting.popleft()
                c = self.cohort
                threads.fit(len(c))  # a step feeds one token per row
                tok, finished, streamed = c.pick()
                if streamed and on_tokens is not None:
                    on_tokens([(*c.owner[b], pos, t, lp) for b, pos, t, lp in streamed])
                if finished:
                    self._harvest(c, finished)
                if c.all_done:
                    self.cohort = None
                    return True
                if c.compact_due():
                    keep = (~c.done).nonzero().squeeze(1)  # (n',)
                    tok = tok[keep]
                    c.select(keep)
                    route_for = None  # the adapter keys must follow the rows
                if route_for is not c:
                    routed.close()
                    routed.enter_context(bank.rows(c.keys))
                    route_for = c
                c.forward(self.engine, tok)
                return True

            yield one_step

    def _harvest(self, c: Cohort, rows: list[int]) -> None:
        for b, seq in zip(rows, c.seqs(rows), strict=True):
            self._finished(c.owner[b], seq)

    def _finished(self, owner: tuple[int, int], seq: SampledSeq) -> None:
        h, j = owner
        p = self._pending[h]
        p.seqs[j] = seq
        p.left -= 1
        if p.left == 0:
            p.result.sequences = p.seqs  # type: ignore[assignment]
            self._ready.append((h, p.result))
            del self._pending[h]


@dataclass
class _Admission:
    """What DecodeBatch.prepare made of some requests, for commit: their handles and
    results, the batch's rows with theirs joined, and the samples the prefill finished."""

    handles: list[int]
    requests: list[SampleRequest]
    results: list[SampleResult]
    running: Cohort | None
    waiting: deque[Cohort]
    done: list[tuple[tuple[int, int], SampledSeq]]


# ---- add, its model passes (the plan: sample_plan.py, the decode rows: sample_cohort.py) --


def _score(
    engine: Any, plan: _Plan, requests: list[SampleRequest], results: list[SampleResult]
) -> None:
    """Scoring rows need full logits and no cache: run apart, longest first, in chunks
    whose (rows, T, V) logits fit LOGITS_BUDGET."""
    scoring = sorted(
        (r for r in range(len(plan.keys)) if not plan.generating[r]),
        key=lambda r: -len(plan.keys[r][1]),
    )
    for chunk in _chunks(scoring, [len(plan.keys[r][1]) for r in scoring], engine.vocab_size):
        logits, _, T = _prefill(engine, [plan.keys[r] for r in chunk], True, use_cache=False)
        plan.collect(logits, chunk, T, requests, results)
        del logits


def _prefill_and_expand(
    engine: Any,
    plan: _Plan,
    requests: list[SampleRequest],
    results: list[SampleResult],
    handles: list[int],
    stream: list[bool],
) -> Cohort | None:
    """The generating prompts' prefill, expanded to one decode row per sample (None: no
    request generates)."""
    generating = [i for i, r in enumerate(requests) if r.params.max_tokens > 0]
    if not generating:
        return None
    gen_rows = [r for r in range(len(plan.keys)) if plan.generating[r]]
    full = any(r in plan.topks for r in gen_rows)
    M = max(requests[i].params.max_tokens for i in generating)
    # with max_tokens 1 everywhere the prefill logits give every token: no cache needed
    pc = getattr(engine, "prefix_cache", None)
    if pc is None:
        logits, cache, T = _prefill(engine, [plan.keys[r] for r in gen_rows], full, M > 1)
    else:  # from cached prefixes where it can (treadle.engine.sample_prefill)
        logits, cache, T = _prefill_cached(engine, pc, plan, requests, results, gen_rows, M > 1)
    if full:
        plan.collect(logits, gen_rows, T, requests, results)
    last = logits[:, -1]  # (P, V): left padding puts every prompt's last token at T-1
    del logits
    local = {r: j for j, r in enumerate(gen_rows)}
    src = [local[plan.row_of_req[i]] for i in generating for _ in range(requests[i].num_samples)]
    device = last.device
    src_t = None if src == list(range(len(gen_rows))) else torch.tensor(src, device=device)
    preallocate(cache, src_t, T + M)
    return _cohort(
        engine,
        [requests[i] for i in generating],
        [handles[i] for i in generating],
        [stream[i] for i in generating],
        last if src_t is None else last[src_t],
        cache,
        T,
    )


def _prefill_cached(
    engine: Any,
    pc: Any,
    plan: _Plan,
    requests: list[SampleRequest],
    results: list[SampleResult],
    gen_rows: list[int],
    use_cache: bool,
) -> tuple[torch.Tensor, Any, int]:
    """_prefill's pass with the engine's prefix cache; each generating request's result
    gets the prompt tokens its own scope's cache held."""
    scopes: dict[int, list[str]] = {r: [] for r in gen_rows}
    for req, r in zip(requests, plan.row_of_req, strict=True):
        if r in scopes and req.prefix_scope not in scopes[r]:
            scopes[r].append(req.prefix_scope)
    needs_full = [r in plan.topks or r in plan.per_request for r in gen_rows]
    logits, cache, T, hits = prefill_with_prefixes(
        engine, pc, [plan.keys[r] for r in gen_rows], [scopes[r] for r in gen_rows],
        needs_full, any(needs_full), use_cache,
    )  # fmt: skip
    local = {r: j for j, r in enumerate(gen_rows)}
    for req, res, r in zip(requests, results, plan.row_of_req, strict=True):
        if r in local:
            res.prompt_cache_hit_tokens = hits[local[r]][req.prefix_scope]
    return logits, cache, T


def _chunks(rows: list[int], lens: list[int], vocab_size: int) -> list[list[int]]:
    """Split rows (sorted longest first) so that each chunk's padded logits fit the budget."""
    chunks: list[list[int]] = []
    T = 0  # padded length of the current chunk: that of its first, longest row
    for r, n in zip(rows, lens, strict=True):
        if not chunks or (len(chunks[-1]) + 1) * T * vocab_size > LOGITS_BUDGET:
            chunks.append([])
            T = n
        chunks[-1].append(r)
    return chunks


def _prefill(
    engine: Any,
    prefill_keys: list[tuple[str | None, tuple[int, ...]]],
    full_logits: bool,
    use_cache: bool,
) -> tuple[torch.Tensor, Any, int]:
    """One left-padded forward over distinct prompts: (logits, cache or None, padded length T).

    Logits are (P, T, V) with full_logits (prompt logprobs), else (P, 1, V).
    """
    device = torch.device(engine.device)
    lens = [len(p) for _, p in prefill_keys]
    P, T = len(lens), max(lens)
    ids = torch.zeros(P, T, dtype=torch.long)  # (P, T); pad id 0 is masked out anyway
    for r, (_, prompt) in enumerate(prefill_keys):
        ids[r, T - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
    lens_t = torch.tensor(lens, dtype=torch.long)
    pos = torch.arange(T)[None, :] - (T - lens_t)[:, None]  # (P, T), negative on padding
    mask = (pos >= 0).long()  # (P, T)
    pos = pos.clamp(min=0)
    with engine.bank.rows([a for a, _ in prefill_keys]):
        out = engine.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=pos.to(device),
            use_cache=use_cache,
            logits_to_keep=0 if full_logits else 1,
        )
    cache = getattr(out, cache_arg(type(engine.model))) if use_cache else None
    return out.logits, cache, T
