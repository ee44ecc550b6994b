"""The rows of a decode batch: what each row samples with, what it has sampled, and the KV
cache they share. `treadle.engine.sample` builds cohorts from prefills and steps them.

A Cohort is a set of rows that share one KV cache of length `length`: every row's tokens
(its prompt, then what it sampled) are a suffix of the cache, the left padding before them
masked out. Rows decode at their own pace: each has its own step count (tokens sampled so
far), so rows that joined later (continuous batching, `join`) sit beside rows that are
hundreds of tokens in. One decode step:

1. `pick`: one token per row from its raw logits (sample_utils.pick_tokens, with the row's
   own pre-drawn uniform for its own step), after the row's own controls where it has any
   (treadle.engine.sample_controls: constraint, logit_bias, penalties), written into the
   row's output buffers; rows that hit a stop token, a stop string or max_tokens, or whose
   constraint is complete, are done;
2. `select` (from time to time): done rows leave the batch, and the columns of the cache that
   are padding for every remaining row are cut off, so a long-lived batch does not grow;
3. `forward`: the model takes the picked token of every row and gives the logits of the
   next one.

Finished rows' results are read out (`seq`) right when they finish, so that `select` may
drop them at any time after.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields
from typing import Any

import torch

from treadle.engine.sample_controls import RowControls, controlled_logits
from treadle.engine.sample_utils import (
    StopStringMatcher,
    growing,
    join_caches,
    pick_tokens,
    select_cache_rows,
)
from treadle.engine.types import SampledSeq

# Drop finished rows from the decode batch once this fraction of the batch has finished:
# compaction copies the whole KV cache, so doing it for every single finished row costs more
# than it saves.
COMPACT_FRACTION = 0.25


@functools.cache
def cache_arg(model_type: type) -> str:
    """transformers 5.x names the KV cache argument and output `cache`, 4.x `past_key_values`."""
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass
class Cohort:
    """Rows sharing one KV cache. Per-row tensors are (n, ...); W is the width of the output
    buffers, max_tokens + 1 of the longest row: its last column is where done rows write."""

    owner: list[tuple[int, int]]  # (request handle, sample index) of each row
    keys: list[str | None]  # adapter key per row, what engine.bank.rows receives
    topk: list[int]  # top-K logprobs each row's request asks for (0: none)
    matchers: list[StopStringMatcher | None]  # rows with stop strings
    controls: list[RowControls | None]  # rows with logit controls (constraint, bias, penalties)
    cache: Any  # the HF cache; None when every row ends at its first token
    length: int  # filled positions of the cache
    mask: torch.Tensor  # (n, C) int64 attention mask over the cache's capacity, ones from length
    logits: torch.Tensor  # (n, V) raw logits of each row's next token
    prompt_len: torch.Tensor  # (n,) int64
    temperature: torch.Tensor  # (n,) fp32, 1 where greedy so that dividing is harmless
    greedy: torch.Tensor  # (n,) bool
    top_k: torch.Tensor  # (n,) int64, V where off
    top_p: torch.Tensor  # (n,) fp32
    min_p: torch.Tensor  # (n,) fp32, 0 where off
    shaped: torch.Tensor  # (n,) bool: drawn from another distribution than the raw one
    max_tokens: torch.Tensor  # (n,) int64
    stop_ids: torch.Tensor  # (n, S) int64, -1 pads
    uniforms: torch.Tensor  # (n, W) fp32, the random draw of each step
    stream: torch.Tensor  # (n,) bool: report this row's tokens as they come
    step: torch.Tensor  # (n,) int64 tokens sampled so far
    done: torch.Tensor  # (n,) bool
    stopped: torch.Tensor  # (n,) bool: ended by a stop token or string (else by max_tokens)
    tokens: torch.Tensor  # (n, W) int64
    logprobs: torch.Tensor  # (n, W) fp32
    sampling_lp: torch.Tensor  # (n, W) fp32, under the distribution each token was drawn from
    top_ids: torch.Tensor  # (n, W, K) int64, K = max(topk)
    top_lp: torch.Tensor  # (n, W, K) fp32
    n_done: int = 0  # done rows still in the batch

    def __post_init__(self) -> None:
        self._flags()

    def __len__(self) -> int:
        return len(self.owner)

    @property
    def all_done(self) -> bool:
        return self.n_done == len(self)

    def _flags(self) -> None:
        """Facts of the rows that let a step skip work no row needs (one sync, when rows change)."""
        V = self.logits.shape[-1]
        self.all_greedy = bool(self.greedy.all())
        self.any_filter = bool(((self.top_k < V) | (self.top_p < 1)).any())
        self.any_stream = bool(self.stream.any())
        self.any_min_p = bool((self.min_p > 0).any())
        self.any_shaped = bool(self.shaped.any())
        self.K = self.top_ids.shape[-1]
        self._matcher_pos = [b for b, m in enumerate(self.matchers) if m is not None]
        self._control_pos = [b for b, c in enumerate(self.controls) if c is not None]

    # ---- one decode step ----
    def pick(self) -> tuple[torch.Tensor, list[int], list[tuple[int, int, int, int, float]]]:
        """Choose the next token of every row: → tokens (n,), the batch positions of the rows
        that finished with it, and (row, position, token, logprob) of each streamed row."""
        W = self.tokens.shape[1]
        live = ~self.done  # (n,)
        at = torch.where(self.done, W - 1, self.step)  # (n,) done rows write the spare column
        u = self.uniforms.gather(1, at[:, None]).squeeze(1)  # (n,)
        controlled, ctl_rows = None, []
        if self._control_pos:  # the live rows with controls (one host sync)
            alive = live[self._control_pos].tolist()
            ctl_rows = [b for b, a in zip(self._control_pos, alive, strict=True) if a]
        if ctl_rows:
            ctl = [self.controls[b] for b in ctl_rows]
            controlled = controlled_logits(self.logits, ctl_rows, ctl)  # type: ignore[arg-type]
        tok, lp, slp = pick_tokens(
            self.logits, self.greedy, self.temperature, self.top_k, self.top_p, u,
            all_greedy=self.all_greedy, any_filter=self.any_filter, controlled=controlled,
            min_p=self.min_p if self.any_min_p else None, sampling_logprobs=self.any_shaped,
        )  # fmt: skip
        self.tokens.scatter_(1, at[:, None], tok[:, None])
        self.logprobs.scatter_(1, at[:, None], lp[:, None])
        if slp is not None:
            self.sampling_lp.scatter_(1, at[:, None], slp[:, None])
        if self.K:  # of the raw distribution, like the sampled logprobs
            vals, ids = self.logits.float().log_softmax(-1).topk(self.K, dim=-1)  # (n, K)
            rows = torch.arange(len(self), device=at.device)
            self.top_ids[rows, at] = ids
            self.top_lp[rows, at] = vals
        hit = (tok[:, None] == self.stop_ids).any(-1)  # (n,)
        if self._matcher_pos:
            hit |= self._stop_string_hits(tok, live)
        if ctl_rows:
            hit |= self._constraint_hits(tok, ctl_rows)
        self.step += live
        new = live & (hit | (self.step >= self.max_tokens))  # (n,)
        streamed = self._streamed(live, at, tok, lp) if self.any_stream else []
        finished: list[int] = []
        if int(new.sum()):  # the one host sync of a step
            self.stopped |= new & hit
            self.done |= new
            finished = new.nonzero().squeeze(1).tolist()
            self.n_done += len(finished)
        return tok, finished, streamed

    def _streamed(
        self, live: torch.Tensor, at: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor
    ) -> list[tuple[int, int, int, int, float]]:
        b = (live & self.stream).nonzero().squeeze(1)  # (s,)
        cols = [b, at[b], tok[b], lp[b]]
        return list(zip(*(c.tolist() for c in cols), strict=True))

    def _stop_string_hits(self, tok: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """(n,) bool: live rows whose generated text now contains one of their stop strings.

        Only rows with stop strings are looked at (and moved to the CPU).
        """
        hits = torch.zeros(len(self), dtype=torch.bool)
        pos = self._matcher_pos
        for b, t, alive in zip(pos, tok[pos].tolist(), live[pos].tolist(), strict=True):
            if alive and self.matchers[b].push(t):  # type: ignore[union-attr]
                hits[b] = True
        return hits.to(tok.device)

    def _constraint_hits(self, tok: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """(n,) bool: the rows (of `rows`, live ones with controls) whose constraint is
        complete with this token; every one of them notes its token."""
        hits = torch.zeros(len(self), dtype=torch.bool)
        for b, t in zip(rows, tok[rows].tolist(), strict=True):
            if self.controls[b].accept(t):  # type: ignore[union-attr]
                hits[b] = True
        return hits.to(tok.device)

    def compact_due(self) -> bool:
        return self.n_done >= max(1, int(COMPACT_FRACTION * len(self)))

    def select(self, keep: torch.Tensor) -> None:
        """Keep batch rows `keep` (a (n',) index tensor), and cut off the leading cache
        columns that are padding for every kept row."""
        kept = keep.tolist()
        for name in ("owner", "keys", "topk", "matchers", "controls"):
            setattr(self, name, [getattr(self, name)[i] for i in kept])
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, value[keep])
        first = int(self.mask[:, : self.length].argmax(1).min())  # the first unmasked column
        first = select_cache_rows(self.cache, keep, first)
        self.mask = self.mask[:, first:]
        self.length -= first
        self.n_done = int(self.done.sum())
        self._flags()

    def forward(self, engine: Any, tok: torch.Tensor) -> None:
        """Feed each row's picked token (n,): the logits of the next one, the cache one longer.
        The caller has routed the rows (engine.bank.rows(self.keys))."""
        L = self.length
        out = engine.model(
            input_ids=tok[:, None],  # (n, 1)
            attention_mask=self.mask[:, : L + 1],  # (n, L + 1)
            position_ids=(self.prompt_len + self.step - 1)[:, None],  # (n, 1)
            use_cache=True,
            **{cache_arg(type(engine.model)): self.cache},
            logits_to_keep=1,
        )
        self.logits = out.logits[:, -1]  # (n, V)
        self.length = L + 1

    # ---- results ----
    def seqs(self, rows: list[int]) -> list[SampledSeq]:
        """The finished rows' sequences (one host copy for all of them)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.step.device)
        n_l = self.step[idx].tolist()
        stop_l = self.stopped[idx].tolist()
        tok_l, lp_l = self.tokens[idx].tolist(), self.logprobs[idx].tolist()
        shaped_l = self.shaped[idx].tolist()
        slp_l = self.sampling_lp[idx].tolist() if any(shaped_l) else None
        want_top = any(self.topk[b] for b in rows)
        top_l = (self.top_ids[idx].tolist(), self.top_lp[idx].tolist()) if want_top else None
        out = []
        for i, b in enumerate(rows):
            n = n_l[i]
            seq = SampledSeq(tok_l[i][:n], lp_l[i][:n], "stop" if stop_l[i] else "length")
            if shaped_l[i] and slp_l is not None:
                seq.sampling_logprobs = slp_l[i][:n]
            k = self.topk[b]
            if k and top_l is not None:
                seq.topk = [
                    list(zip(ids[:k], lps[:k], strict=True))
                    for ids, lps in zip(top_l[0][i][:n], top_l[1][i][:n], strict=True)
                ]
            out.append(seq)
        return out


def joinable(c: Cohort) -> bool:
    """Whether another cohort can join this one (every cache layer a GrowingLayer)."""
    return growing(c.cache)


def join(a: Cohort, b: Cohort) -> Cohort:
    """One cohort of a's unfinished rows and all of b's: both caches right-aligned in one
    buffer (the shorter one left-padded and masked), sized for the longest row still to go.

    Both must be `joinable`. Rows keep their own positions, steps and draws, so a row
    samples what it would have sampled in either cohort alone.
    """
    keep = (~a.done).nonzero().squeeze(1)  # (na,)
    if not len(keep):
        return b
    first_a = int(a.mask[keep, : a.length].argmax(1).min())
    len_a, len_b = a.length - first_a, b.length
    L = max(len_a, len_b)
    remaining = torch.cat([(a.max_tokens - a.step)[keep], b.max_tokens - b.step])
    capacity = L + int(remaining.max())
    cache = join_caches(a.cache, keep, first_a, b.cache, L, capacity)
    n_a, n_b = len(keep), len(b)
    mask = torch.ones(n_a + n_b, capacity, dtype=torch.long, device=b.mask.device)  # (n, C)
    mask[:, :L] = 0
    mask[:n_a, L - len_a : L] = a.mask[keep, first_a : a.length]
    mask[n_a:, L - len_b : L] = b.mask[:, :len_b]
    # output buffers and draws: the wider of the two (columns past a row's max_tokens are
    # never read), top-K the larger; stop ids padded with -1
    W = max(a.tokens.shape[1], b.tokens.shape[1])
    K = max(a.top_ids.shape[-1], b.top_ids.shape[-1])
    S = max(a.stop_ids.shape[1], b.stop_ids.shape[1])
    widths = {"uniforms": W, "tokens": W, "logprobs": W, "sampling_lp": W, "top_ids": W}
    widths |= {"top_lp": W, "stop_ids": S}

    def cat(name: str) -> torch.Tensor:
        x, y = getattr(a, name)[keep], getattr(b, name)
        if name in widths:
            fill = -1 if name == "stop_ids" else 0
            x, y = _widen(x, widths[name], K, fill), _widen(y, widths[name], K, fill)
        return torch.cat([x, y])

    tensors = {
        f.name: cat(f.name)
        for f in fields(Cohort)
        if isinstance(getattr(b, f.name), torch.Tensor) and f.name != "mask"
    }
    kept = keep.tolist()
    return Cohort(
        owner=[a.owner[i] for i in kept] + b.owner,
        keys=[a.keys[i] for i in kept] + b.keys,
        topk=[a.topk[i] for i in kept] + b.topk,
        matchers=[a.matchers[i] for i in kept] + b.matchers,
        controls=[a.controls[i] for i in kept] + b.controls,
        cache=cache,
        length=L,
        mask=mask,
        **tensors,
    )


def _widen(t: torch.Tensor, W: int, K: int, fill: int) -> torch.Tensor:
    """(n, w) or (n, w, k) padded on the right to (n, W) or (n, W, K)."""
    pad = [0, K - t.shape[2]] if t.dim() == 3 else []
    pad += [0, W - t.shape[1]]  # F.pad lists the last dim first
    return torch.nn.functional.pad(t, pad, value=fill) if any(pad) else t
