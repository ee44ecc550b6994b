"""Batched sampling with a KV cache: every request of a call decodes in one batch.

`sample(engine, requests)` is what `Engine.sample` runs. One call mixes requests of several
adapters (or snapshots, or the base model), prompt lengths and sampling settings:

1. prefill: each distinct (adapter, prompt) is run once, left-padded into one batch, with the
   per-row adapter keys handed to `engine.bank.rows`; prompt logprobs come out of this pass
   (prompts that are only scored, max_tokens 0, run apart without a cache, in chunks);
2. expand: the cache rows are repeated so that the `num_samples` completions of a prompt share
   its single prefill, into buffers sized for the whole decode (`sample_utils.preallocate`);
3. decode: one token per row per step, chosen by `sample_utils.pick_tokens` (vectorised
   temperature / top-k / top-p, one pre-drawn uniform per row and step); finished rows are
   dropped from the batch once enough of them have finished, so they stop costing work.

Logprobs reported for sampled tokens are log_softmax of the raw logits in fp32, not of the
temperature / top-k / top-p adjusted distribution: the trainer computes exactly this quantity
for the same tokens, so importance ratios between sampler and trainer are 1 when the weights
are the same.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import secrets
from dataclasses import dataclass, field
from typing import Any

import torch

from treadle.engine.sample_utils import (
    StopStringMatcher,
    alt_tokens_of_row,
    pick_tokens,
    preallocate,
    prompt_logprobs_of_row,
    target_logprobs_of_row,
    validate_request,
)
from treadle.engine.types import SampledSeq, SampleRequest, SampleResult


@functools.cache
def _cache_arg(model_type: type) -> str:
    """transformers 5.x names the KV cache argument and output `cache`, 4.x `past_key_values`."""
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


# Scoring prefills are split so that their full (rows, T, V) logits stay under this many
# elements: compute_logprobs over many long prompts must not allocate rows * T * V at once.
LOGITS_BUDGET = 2**27

# Drop finished rows from the decode batch once this fraction of the batch has finished:
# compaction copies the whole KV cache, so doing it for every single finished row costs more
# than it saves.
COMPACT_FRACTION = 0.25


@dataclass
class _Decode:
    """State of the rows still in the decode batch; `rows` maps batch index -> output row."""

    rows: torch.Tensor  # (n,) int64 index into the (N, M) output buffers
    keys: list[str | None]  # adapter key per batch row, what engine.bank.rows receives
    prompt_len: torch.Tensor  # (n,) int64
    temperature: torch.Tensor  # (n,) fp32, 1 where greedy so that dividing is harmless
    greedy: torch.Tensor  # (n,) bool
    top_k: torch.Tensor  # (n,) int64, V where off
    top_p: torch.Tensor  # (n,) fp32
    max_tokens: torch.Tensor  # (n,) int64
    stop_ids: torch.Tensor  # (n, S) int64, -1 pads
    uniforms: torch.Tensor  # (n, M) fp32, the random draw of each step
    mask: torch.Tensor  # (n, T + M) int64 attention mask, left padding zeros
    done: torch.Tensor  # (n,) bool
    matchers: dict[int, StopStringMatcher] = field(default_factory=dict)  # by output row
    _matcher_pos: list[int] | None = None

    def matcher_pos(self) -> list[int]:
        """Batch positions of the rows that have stop strings."""
        if self._matcher_pos is None:
            self._matcher_pos = [b for b, r in enumerate(self.rows.tolist()) if r in self.matchers]
        return self._matcher_pos

    def select(self, keep: torch.Tensor) -> None:
        """Keep batch rows `keep` (a (n',) index tensor) in every per-row tensor."""
        kept = keep.tolist()
        self.keys = [self.keys[i] for i in kept]
        for name in (
            "rows", "prompt_len", "temperature", "greedy", "top_k", "top_p",
            "max_tokens", "stop_ids", "uniforms", "mask", "done",
        ):  # fmt: skip
            setattr(self, name, getattr(self, name)[keep])
        self._matcher_pos = None


def sample(engine: Any, requests: list[SampleRequest]) -> list[SampleResult]:
    """Run all requests together and return one SampleResult per request, in order.

    `engine` provides model, bank (bank.rows(keys) routes batch rows to adapters), tokenizer,
    eos_token_ids, vocab_size, max_seq_len and device. Raises InvalidRequestError naming the
    field for any invalid request, before any model work.
    """
    for i, req in enumerate(requests):
        validate_request(engine, req, i)
    with torch.inference_mode():
        return _run(engine, requests)


def _run(engine: Any, requests: list[SampleRequest]) -> list[SampleResult]:
    device = torch.device(engine.device)
    results = [SampleResult(sequences=[]) for _ in requests]
    for req, res in zip(requests, results, strict=True):
        if req.params.max_tokens == 0:
            res.sequences = [SampledSeq([], [], "length") for _ in range(req.num_samples)]

    # One prefill row per distinct (adapter, prompt). A row is "generating" if some request
    # decodes from it, else it only scores its prompt; requests that want neither prompt
    # logprobs nor new tokens need no model work at all.
    row_of: dict[tuple[str | None, tuple[int, ...]], int] = {}
    row_of_req: list[int] = []
    for req in requests:
        if _wants_prompt_logprobs(req) or req.params.max_tokens > 0:
            key = (req.adapter, tuple(req.prompt))
            row_of_req.append(row_of.setdefault(key, len(row_of)))
        else:
            row_of_req.append(-1)
    row_keys = list(row_of)
    topks: dict[int, set[int]] = {}  # row -> the top-K sizes its requests ask for (0: none)
    per_request: dict[int, list[int]] = {}  # row -> requests with target ids or alt draws
    generating_row = [False] * len(row_keys)
    for i, (req, r) in enumerate(zip(requests, row_of_req, strict=True)):
        if _wants_prompt_logprobs(req):
            topks.setdefault(r, set()).add(req.topk_prompt_logprobs)
        if req.target_prompt_ids is not None or req.prompt_alt_tokens_k > 0:
            per_request.setdefault(r, []).append(i)
        if req.params.max_tokens > 0:
            generating_row[r] = True

    # Prompt logprobs, once per (row, top-K) even when several requests share the row.
    memo: dict[tuple[int, int], tuple[list, list | None]] = {}

    def collect(logits: torch.Tensor, rows: list[int], T: int) -> None:
        for local, r in enumerate(rows):
            prompt = row_keys[r][1]
            for k in topks.get(r, ()):
                memo[(r, k)] = prompt_logprobs_of_row(logits[local], prompt, T, k)
            for i in per_request.get(r, ()):
                req, res = requests[i], results[i]
                if req.target_prompt_ids is not None:
                    res.target_prompt_logprobs = target_logprobs_of_row(
                        logits[local], len(prompt), T, req.target_prompt_ids
                    )
                if req.prompt_alt_tokens_k > 0:
                    sp = req.params
                    res.prompt_alt_tokens = alt_tokens_of_row(
                        logits[local], len(prompt), T, req.prompt_alt_tokens_k,
                        sp.temperature, sp.seed,
                    )  # fmt: skip

    # Scoring rows (compute_logprobs) need full logits and no cache: run them apart, longest
    # first, in chunks whose (rows, T, V) logits fit LOGITS_BUDGET.
    scoring = sorted(
        (r for r in range(len(row_keys)) if not generating_row[r]),
        key=lambda r: -len(row_keys[r][1]),
    )
    for chunk in _chunks(scoring, [len(row_keys[r][1]) for r in scoring], engine.vocab_size):
        logits, _, T = _prefill(engine, [row_keys[r] for r in chunk], True, use_cache=False)
        collect(logits, chunk, T)
        del logits

    generating = [i for i, r in enumerate(requests) if r.params.max_tokens > 0]
    if generating:
        gen_rows = [r for r in range(len(row_keys)) if generating_row[r]]
        full = any(r in topks for r in gen_rows)
        M = max(requests[i].params.max_tokens for i in generating)
        # with max_tokens 1 everywhere the prefill logits give every token: no cache needed
        logits, cache, T = _prefill(engine, [row_keys[r] for r in gen_rows], full, M > 1)
        if full:
            collect(logits, gen_rows, T)
        last = logits[:, -1]  # (P, V): left padding puts every prompt's last token at T-1
        del logits
        local = {r: j for j, r in enumerate(gen_rows)}
        state, src = _expand(
            engine, requests, generating, [local.get(r, -1) for r in row_of_req], T, device
        )
        preallocate(cache, src, T + M)
        if src is not None:
            last = last[src]  # (N, V)
        K = max(requests[i].topk_sample_logprobs for i in generating)
        tokens, logprobs, length, stopped, topk = _decode(engine, state, cache, last, T, K)
        tokens_l, logprobs_l = tokens.tolist(), logprobs.tolist()
        length_l, stopped_l = length.tolist(), stopped.tolist()
        topk_l = (topk[0].tolist(), topk[1].tolist()) if topk is not None else None
        row = 0
        for i in generating:
            seqs = []
            k_i = requests[i].topk_sample_logprobs
            for _ in range(requests[i].num_samples):
                n = length_l[row]
                reason = "stop" if stopped_l[row] else "length"
                seq = SampledSeq(tokens_l[row][:n], logprobs_l[row][:n], reason)
                if k_i > 0 and topk_l is not None:
                    ids_row, lps_row = topk_l[0][row][:n], topk_l[1][row][:n]
                    seq.topk = [
                        list(zip(ids[:k_i], lps[:k_i], strict=True))
                        for ids, lps in zip(ids_row, lps_row, strict=True)
                    ]
                seqs.append(seq)
                row += 1
            results[i].sequences = seqs

    for i, req in enumerate(requests):
        if _wants_prompt_logprobs(req):
            lps, topk = memo[(row_of_req[i], req.topk_prompt_logprobs)]
            if req.prompt_logprobs:
                results[i].prompt_logprobs = lps
            if req.topk_prompt_logprobs > 0:
                results[i].topk_prompt_logprobs = topk
    return results


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


def _wants_prompt_logprobs(req: SampleRequest) -> bool:
    """Whether the request needs the prefill's logits at every prompt position."""
    return (
        req.prompt_logprobs
        or req.topk_prompt_logprobs > 0
        or req.target_prompt_ids is not None
        or req.prompt_alt_tokens_k > 0
    )


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
    cache = getattr(out, _cache_arg(type(engine.model))) if use_cache else None
    return out.logits, cache, T


def _expand(
    engine: Any,
    requests: list[SampleRequest],
    generating: list[int],
    row_of_req: list[int],
    T: int,
    device: torch.device,
) -> tuple[_Decode, torch.Tensor | None]:
    """Per-row decode state (one row per sample) and the prefill row each one reads.

    row_of_req[i] is request i's row in the generating prefill. The second value is None
    when the decode rows are exactly the prefill rows.
    """
    V = int(engine.vocab_size)
    eos = [int(t) for t in engine.eos_token_ids]
    M = max(requests[i].params.max_tokens for i in generating)
    src, keys, plen, temp, topk, topp, maxtok, stops, unif = [], [], [], [], [], [], [], [], []
    matchers: dict[int, StopStringMatcher] = {}
    for i in generating:
        req, sp = requests[i], requests[i].params
        # One generator per request, drawn on the CPU: sample j of a request with a given seed
        # gets the same uniforms whatever else is in the batch and whatever the device.
        seed = sp.seed if sp.seed is not None else secrets.randbits(63)
        gen = torch.Generator().manual_seed(seed)
        u = torch.rand(req.num_samples, sp.max_tokens, generator=gen)  # (num_samples, m)
        u = torch.nn.functional.pad(u, (0, M - sp.max_tokens))  # (num_samples, M)
        stop_ids = list(dict.fromkeys(sp.stop_tokens + (eos if sp.stop_at_eos else [])))
        for j in range(req.num_samples):
            if sp.stop_strings:
                matchers[len(src)] = StopStringMatcher(engine.tokenizer, sp.stop_strings)
            src.append(row_of_req[i])
            keys.append(req.adapter)
            plen.append(len(req.prompt))
            temp.append(sp.temperature if sp.temperature > 0 else 1.0)
            topk.append(sp.top_k if sp.top_k > 0 else V)
            topp.append(sp.top_p)
            maxtok.append(sp.max_tokens)
            stops.append(stop_ids)
            unif.append(u[j])
    N, S = len(src), max(len(s) for s in stops)
    stop_t = torch.full((N, S), -1, dtype=torch.long)
    for r, s in enumerate(stops):
        stop_t[r, : len(s)] = torch.tensor(s, dtype=torch.long)
    plen_t = torch.tensor(plen, dtype=torch.long)
    mask = torch.ones(N, T + M, dtype=torch.long)  # (N, T + M)
    mask[:, :T] = (torch.arange(T)[None, :] >= (T - plen_t)[:, None]).long()
    greedy = torch.tensor([requests[i].params.temperature == 0 for i in generating])
    greedy = greedy.repeat_interleave(torch.tensor([requests[i].num_samples for i in generating]))
    state = _Decode(
        rows=torch.arange(N, device=device),
        keys=keys,
        prompt_len=plen_t.to(device),
        temperature=torch.tensor(temp, dtype=torch.float32, device=device),
        greedy=greedy.to(device),
        top_k=torch.tensor(topk, dtype=torch.long, device=device),
        top_p=torch.tensor(topp, dtype=torch.float32, device=device),
        max_tokens=torch.tensor(maxtok, dtype=torch.long, device=device),
        stop_ids=stop_t.to(device),
        uniforms=torch.stack(unif).to(device),
        mask=mask.to(device),
        done=torch.zeros(N, dtype=torch.bool, device=device),
        matchers=matchers,
    )
    identity = src == list(range(max(src) + 1))
    return state, None if identity else torch.tensor(src, dtype=torch.long, device=device)


def _decode(
    engine: Any, st: _Decode, cache: Any, logits: torch.Tensor, T: int, K: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
    """The decode loop. Returns tokens (N, M), logprobs (N, M), lengths (N,), stopped (N,),
    and with K > 0 the top K (ids (N, M, K), logprobs (N, M, K)) at every step, else None."""
    N, M = st.uniforms.shape
    device = st.rows.device
    out_tok = torch.zeros(N, M, dtype=torch.long, device=device)  # (N, M)
    out_lp = torch.zeros(N, M, dtype=torch.float32, device=device)  # (N, M)
    top_ids = torch.zeros(N, M, K, dtype=torch.long, device=device)  # (N, M, K)
    top_lp = torch.zeros(N, M, K, dtype=torch.float32, device=device)  # (N, M, K)
    out_len = torch.zeros(N, dtype=torch.long, device=device)  # (N,)
    out_stop = torch.zeros(N, dtype=torch.bool, device=device)  # (N,)
    any_filter = bool(((st.top_k < logits.shape[-1]) | (st.top_p < 1)).any())
    all_greedy = bool(st.greedy.all())
    cache_arg = _cache_arg(type(engine.model))

    with contextlib.ExitStack() as rows_ctx:
        rows_ctx.enter_context(engine.bank.rows(st.keys))
        k, n_done = 0, 0  # step, finished rows still in the batch
        while True:
            tok, lp = pick_tokens(
                logits, st.greedy, st.temperature, st.top_k, st.top_p, st.uniforms[:, k],
                all_greedy=all_greedy, any_filter=any_filter,
            )  # fmt: skip
            out_tok[st.rows, k] = tok
            out_lp[st.rows, k] = lp
            if K:  # of the raw distribution, like the sampled logprobs
                vals, ids = logits.float().log_softmax(-1).topk(K, dim=-1)  # (n, K)
                top_ids[st.rows, k] = ids
                top_lp[st.rows, k] = vals
            hit = (tok[:, None] == st.stop_ids).any(-1)  # (n,)
            if st.matchers:
                hit |= _stop_string_hits(st, tok)
            new = ~st.done & (hit | (st.max_tokens <= k + 1))  # (n,)
            n_new = int(new.sum())  # the one host sync of a step
            if n_new:
                # indexed by row ids, not by the mask: no second sync on an accelerator
                out_len[st.rows] = torch.where(new, k + 1, out_len[st.rows])
                out_stop[st.rows] = torch.where(new, hit, out_stop[st.rows])
                st.done |= new
                n_done += n_new
            n = len(st.keys)
            if n_done == n:
                break
            if n_done >= max(1, int(COMPACT_FRACTION * n)):
                keep = (~st.done).nonzero().squeeze(1)  # (n',)
                tok = tok[keep]
                st.select(keep)
                cache.batch_select_indices(keep)
                n_done = 0
                rows_ctx.close()  # the adapter keys must follow the rows
                rows_ctx.enter_context(engine.bank.rows(st.keys))
            out = engine.model(
                input_ids=tok[:, None],  # (n, 1)
                attention_mask=st.mask[:, : T + k + 1],  # (n, T + k + 1)
                position_ids=(st.prompt_len + k)[:, None],  # (n, 1)
                use_cache=True,
                **{cache_arg: cache},
                logits_to_keep=1,
            )
            logits = out.logits[:, -1]  # (n, V)
            k += 1
    return out_tok, out_lp, out_len, out_stop, ((top_ids, top_lp) if K else None)


def _stop_string_hits(st: _Decode, tok: torch.Tensor) -> torch.Tensor:
    """(n,) bool: rows whose generated text now contains one of their stop strings.

    Only rows with stop strings are looked at (and moved to the CPU).
    """
    hits = torch.zeros(len(st.keys), dtype=torch.bool)
    pos = st.matcher_pos()
    for b, r, t in zip(pos, st.rows[pos].tolist(), tok[pos].tolist(), strict=True):
        if st.matchers[r].push(t):
            hits[b] = True
    return hits.to(tok.device)
