"""The decode batch of a worker served with `--sampler vllm`: each request goes to vLLM or
to Treadle's own DecodeBatch, behind one DecodeBatch-like face (add, step, drop, ...), so
the executor and the loop run it unchanged.

vLLM takes the requests VllmSampler.takes (generating ones, on weights the parity gate has
not tripped); Treadle's batch takes the rest (scoring, target ids, prompt logprobs) and
every request vLLM gives back: one whose check failed (treadle.worker.vllm.gate), one it
failed, and all it held when its process died. A request moved that way is sampled again
from its start by Treadle, so none fails on vLLM's account, except a streamed request
whose tokens had already been sent: it fails, saying why, rather than send other tokens.

A request's `num_samples` are vLLM requests of their own (ids `<handle>.<j>.<try>`), seeded
seed + j as vLLM's own fan-out seeds them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from treadle.engine.sample_utils import validate_request
from treadle.engine.types import SampledSeq, SampleRequest, SampleResult
from treadle.errors import TreadleError
from treadle.worker.vllm.process import VllmDied
from treadle.worker.vllm.sampler import VllmSampler, gate_key

log = logging.getLogger("treadle.vllm")

POLL_S = 0.02  # how long a step waits for vLLM when Treadle's batch has no rows
StreamedToken = tuple[int, int, int, int, float]
_TRIES = itertools.count()  # vLLM request ids stay unique across batches of one process


@dataclass
class _Remote:
    """A request vLLM is sampling."""

    request: SampleRequest
    stream: bool
    check: str  # the parity check of its result: "hold" (before it is handed back),
    # "after" (a streamed one: its tokens are out already) or "" (none)
    rids: list[str]
    seqs: list[SampledSeq | None]
    sent: list[int] = field(default_factory=list)  # streamed tokens per sample


class VllmDecodeBatch:
    def __init__(self, engine: Any, sampler: VllmSampler):
        self.engine = engine
        self.sampler = sampler
        self.local = engine.decode_batch()  # Treadle's own
        self._handles = itertools.count()
        self._of_local: dict[int, int] = {}  # the local batch's handle → ours
        self._remote: dict[int, _Remote] = {}
        self._by_rid: dict[str, tuple[int, int]] = {}  # vLLM request id → (handle, sample)
        self._ready: list[tuple[int, SampleResult]] = []
        self._on_tokens: Callable[[list[StreamedToken]], None] | None = None
        self._events: list[dict] = []  # read from vLLM, not handled yet
        self._dead: VllmDied | None = None  # a death _read noticed, for _handle

    def __len__(self) -> int:
        return len(self.local) + len(self._remote) + len(self._ready)

    @property
    def has_results(self) -> bool:
        return bool(self._ready) or self.local.has_results

    def adapter_keys(self) -> set[str]:
        """Treadle's rows' weights, and those of vLLM's requests (a check scores with them,
        and a request given back samples with them): none may be freed meanwhile."""
        keys = {r.request.adapter for r in self._remote.values() if r.request.adapter}
        return self.local.adapter_keys() | keys

    # ---- admitting ----
    def add(self, requests: list[SampleRequest], stream: list[bool] | None = None) -> list[int]:
        stream = list(stream) if stream is not None else [False] * len(requests)
        for i, req in enumerate(requests):
            validate_request(self.engine, req, i)  # all refused before any is taken
        handles = [next(self._handles) for _ in requests]
        local = []
        for h, req, s in zip(handles, requests, stream, strict=True):
            if not (self.sampler.takes(req) and self._submit(h, req, s)):
                local.append((h, req, s))
        if local:
            self._add_local(local)
        return handles

    def _add_local(self, items: list[tuple[int, SampleRequest, bool]]) -> None:
        got = self.local.add([r for _, r, _ in items], stream=[s for _, _, s in items])
        for (h, _, _), lh in zip(items, got, strict=True):
            self._of_local[lh] = h

    def _submit(self, h: int, req: SampleRequest, stream: bool) -> bool:
        """Hand the request to vLLM (→ False: it cannot take it)."""
        try:
            lora = self.sampler.lora_of(req.adapter)
            if lora is None:
                return False
            key = gate_key(req.adapter)
            check = ("after" if stream else "hold") if self.sampler.gate.due(key) else ""
            n, t = req.num_samples, next(_TRIES)
            # vLLM's prefix cache is shared within one cache salt only: a request's prefix
            # scope (the tenant, where the server sets one) never reuses another's blocks
            salt = getattr(req, "prefix_scope", "") or None
            rids = [f"{h}.{j}.{t}" for j in range(n)]
            for j, rid in enumerate(rids):
                self.sampler.process.send(  # type: ignore[union-attr]
                    {"op": "generate", "rid": rid, "prompt": list(req.prompt), "salt": salt,
                     "params": _params(self.engine, req, j), "lora": lora, "stream": stream}
                )  # fmt: skip
        except VllmDied as e:
            self._died(e)
            return False
        self._remote[h] = _Remote(req, stream, check, rids, [None] * n, [0] * n)
        for j, rid in enumerate(rids):
            self._by_rid[rid] = (h, j)
        self.sampler.routed += 1
        return True

    # ---- decoding ----
    def step(
        self,
        max_steps: int = 2**31,
        until: Callable[[], bool] | None = None,
        on_tokens: Callable[[list[StreamedToken]], None] | None = None,
    ) -> list[tuple[int, SampleResult]]:
        """Decode Treadle's rows a step at a time while vLLM's results come in, until
        `until()`, or (without it) until every request is done."""
        self._on_tokens = on_tokens
        local_tokens = None
        if on_tokens is not None:

            def local_tokens(tokens: list[StreamedToken]) -> None:
                on_tokens([(self._of_local[h], j, pos, t, lp) for h, j, pos, t, lp in tokens])

        stop = until or (lambda: False)
        steps = 0
        while steps < max_steps:
            if self.local.rows:
                # vLLM's events are only read between Treadle's steps, and handled after
                # (a check or a request given back runs the engine, outside this decoding)
                done = self.local.step(
                    max_steps=max_steps - steps,
                    until=lambda: self._read(0) or self.has_results or stop(),
                    on_tokens=local_tokens,
                )
                self._ready += [(self._of_local.pop(lh), result) for lh, result in done]
                steps += 1
            elif self._remote:
                self._read(POLL_S)
            self._handle()
            self._take_local()
            if stop() or (until is not None and self.has_results):
                break
            if not self.local.rows and not self._remote:
                break
        self._take_local()
        return self.take_results()

    def take_results(self) -> list[tuple[int, SampleResult]]:
        self._take_local()
        out, self._ready = self._ready, []
        return out

    def _take_local(self) -> None:
        for lh, result in self.local.take_results():
            self._ready.append((self._of_local.pop(lh), result))

    def drop(self, handles: set[int]) -> dict[int, int]:
        """Cancel these requests wherever they run: → tokens each had sampled."""
        mine = {lh: h for lh, h in self._of_local.items() if h in handles}
        sampled = {mine[lh]: n for lh, n in self.local.drop(set(mine)).items()}
        for lh in mine:
            del self._of_local[lh]
        rids = []
        for h in handles & self._remote.keys():
            r = self._remote.pop(h)
            rids += r.rids
            sampled[h] = sum(len(s.tokens) for s in r.seqs if s) + sum(r.sent)
            for rid in r.rids:
                self._by_rid.pop(rid, None)
        if rids and self.sampler.process is not None:
            try:
                self.sampler.process.send({"op": "abort", "rids": rids})
            except VllmDied as e:
                self._died(e)
        self._ready = [(h, r) for h, r in self._ready if h not in handles]
        return sampled

    # ---- vLLM's events ----
    def _read(self, timeout_s: float) -> bool:
        """Read vLLM's events (waiting up to timeout_s for the first); pass streamed
        tokens on at once: → whether some event waits to be handled."""
        if not self._remote:
            return False
        if self.sampler.process is None:  # a death noticed elsewhere: give them back
            self._dead = VllmDied("the vLLM process was stopped")
            return True
        try:
            events = self.sampler.process.events(timeout_s)
        except VllmDied as e:
            self._dead = e
            return True
        for ev in events:
            where = self._by_rid.get(ev.get("rid", ""))
            if where is None:  # a dropped request's, or a LoRA op's late ack
                continue
            if ev["ev"] == "tokens":
                self._streamed(*where, ev)
            else:
                self._events.append(ev)
        return bool(self._events)

    def _handle(self) -> None:
        """Finish the samples vLLM finished (and check them), give back what it failed."""
        events, self._events = self._events, []
        for ev in events:
            where = self._by_rid.get(ev["rid"])
            if where is None:
                continue
            h, j = where
            if ev["ev"] == "done":
                self._sample_done(h, j, ev)
            else:
                log.error("vLLM failed request %s; Treadle's sampler runs it: %s", h, ev["error"])
                self._give_back(h)
        if self._dead is not None:
            error, self._dead = self._dead, None
            self._died(error)

    def _streamed(self, h: int, j: int, ev: dict) -> None:
        r = self._remote[h]
        r.seqs[j] = r.seqs[j] or SampledSeq([], [], "length", [] if _k(r) else None)
        seq = r.seqs[j]
        assert seq is not None
        start = len(seq.tokens)
        seq.tokens += ev["tokens"]
        seq.logprobs += ev["logprobs"]
        if seq.topk is not None:
            seq.topk += [_topk(t, _k(r)) for t in ev["topk"]]
        r.sent[j] = len(seq.tokens)
        if self._on_tokens is not None and ev["tokens"]:
            self._on_tokens(
                [(h, j, start + i, t, lp) for i, (t, lp) in
                 enumerate(zip(ev["tokens"], ev["logprobs"], strict=True))]
            )  # fmt: skip

    def _sample_done(self, h: int, j: int, ev: dict) -> None:
        r = self._remote[h]
        self.sampler.cached_tokens += ev.get("cached", 0)
        if r.stream:
            self._streamed(h, j, ev)
            seq = r.seqs[j]
            assert seq is not None
            seq.stop_reason = ev["finish"]
        else:
            topk = [_topk(t, _k(r)) for t in ev["topk"]] if _k(r) else None
            r.seqs[j] = SampledSeq(ev["tokens"], ev["logprobs"], ev["finish"], topk)
        self._by_rid.pop(r.rids[j], None)
        if any(rid in self._by_rid for rid in r.rids):
            return
        seqs = [s for s in r.seqs if s is not None]
        if r.check:
            req = r.request
            verdict = self.sampler.gate.check(
                self.engine,
                gate_key(req.adapter),
                req.adapter,
                list(req.prompt),
                [(s.tokens, s.logprobs) for s in seqs],
            )
            if not verdict.passed and r.check == "hold":
                self._give_back(h)
                return
        del self._remote[h]
        self._ready.append((h, SampleResult(sequences=seqs)))

    def _give_back(self, h: int) -> None:
        """Sample the request again on Treadle's engine (or fail it, if it streamed)."""
        r = self._remote.pop(h)
        for rid in r.rids:
            self._by_rid.pop(rid, None)
        if self.sampler.process is not None:
            try:
                self.sampler.process.send({"op": "abort", "rids": r.rids})
            except VllmDied:
                pass  # _poll or the next send notices
        if r.stream and any(r.sent):
            self._ready.append((h, _Failed(h)))
            return
        self.sampler.fell_back += 1
        self._add_local([(h, r.request, r.stream)])

    def _died(self, error: Exception) -> None:
        self.sampler.died(error)
        for h in list(self._remote):
            self._give_back(h)


class _Failed(SampleResult):
    """A streamed request whose vLLM process died mid-stream (raised by the executor)."""

    def __init__(self, h: int):
        super().__init__(sequences=[])
        self.error = TreadleError(
            "the vLLM sampler process ended while this request was streaming; its tokens "
            "so far were sent, so it is not sampled again elsewhere: send it again"
        )


def _k(r: _Remote) -> int:
    return r.request.topk_sample_logprobs


def _topk(entries: list[list], k: int) -> list[tuple[int, float]]:
    return [(int(t), float(lp)) for t, lp in entries[:k]]


def _params(engine: Any, req: SampleRequest, j: int) -> dict:
    """A request's settings as vLLM's SamplingParams fields (sample j of it)."""
    p = req.params
    stop_ids = list(
        dict.fromkeys(p.stop_tokens + (list(engine.eos_token_ids) if p.stop_at_eos else []))
    )
    return {
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_k": p.top_k if p.top_k > 0 else 0,
        "top_p": p.top_p,
        "seed": None if p.seed is None else p.seed + j,
        "stop": list(p.stop_strings),
        "stop_token_ids": stop_ids,
        "logprobs": req.topk_sample_logprobs,
    }
