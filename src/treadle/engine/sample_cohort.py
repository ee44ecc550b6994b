"""Phase 4 of DecodeBatch.add (treadle.engine.sample): the decode rows of a prefill.

_cohort turns requests whose prefill is done into a treadle.engine.decode.Cohort: one row
per sample, request-major, with every row's sampling settings, stop tokens and stop strings
as tensors, its logit controls (treadle.engine.sample_controls; a constraint compiled once
per request), and its uniforms pre-drawn from the request's own seed, so that a row's
tokens never depend on what else shares its batch.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch

from treadle.engine.decode import Cohort
from treadle.engine.sample_controls import RowControls
from treadle.engine.sample_utils import StopStringMatcher
from treadle.engine.types import SampleRequest


def _cohort(
    engine: Any,
    requests: list[SampleRequest],
    handles: list[int],
    stream: list[bool],
    logits: torch.Tensor,
    cache: Any,
    T: int,
) -> Cohort:
    """Decode rows (one per sample, request-major) over a prefill of padded length T whose
    cache rows and next-token logits (N, V) are already one per sample."""
    device = logits.device
    V = int(engine.vocab_size)
    eos = [int(t) for t in engine.eos_token_ids]
    M = max(r.params.max_tokens for r in requests)
    W = M + 1  # the spare last column is where finished rows write
    owner, keys, topk, matchers, controls = [], [], [], [], []
    plen, temp, greedy, top_k, top_p, maxtok, stops, unif, streamed = ([] for _ in range(9))
    min_p, shaped = [], []
    for h, req, st in zip(handles, requests, stream, strict=True):
        sp = req.params
        # One generator per request, drawn on the CPU: sample j of a request with a given seed
        # gets the same uniforms whatever else is in the batch and whatever the device.
        seed = sp.seed if sp.seed is not None else secrets.randbits(63)
        gen = torch.Generator().manual_seed(seed)
        u = torch.rand(req.num_samples, sp.max_tokens, generator=gen)  # (num_samples, m)
        u = torch.nn.functional.pad(u, (0, W - sp.max_tokens))  # (num_samples, W)
        stop_ids = list(dict.fromkeys(sp.stop_tokens + (eos if sp.stop_at_eos else [])))
        ctl = RowControls.of(engine, sp, req.prompt, eos, device)
        for j in range(req.num_samples):
            owner.append((h, j))
            keys.append(req.adapter)
            topk.append(req.topk_sample_logprobs)
            matchers.append(
                StopStringMatcher(engine.tokenizer, sp.stop_strings) if sp.stop_strings else None
            )
            plen.append(len(req.prompt))
            temp.append(sp.temperature if sp.temperature > 0 else 1.0)
            greedy.append(sp.temperature == 0)
            top_k.append(sp.top_k if sp.top_k > 0 else V)
            top_p.append(sp.top_p)
            min_p.append(sp.min_p)
            shaped.append(sp.shapes)
            controls.append(None if ctl is None else ctl if j == 0 else ctl.copy())
            maxtok.append(sp.max_tokens)
            stops.append(stop_ids)
            unif.append(u[j])
            streamed.append(st)
    N, S, K = len(owner), max(1, max(len(s) for s in stops)), max(topk)
    stop_t = torch.full((N, S), -1, dtype=torch.long)
    for r, s in enumerate(stops):
        stop_t[r, : len(s)] = torch.tensor(s, dtype=torch.long)
    plen_t = torch.tensor(plen, dtype=torch.long)
    mask = torch.ones(N, T + M, dtype=torch.long)  # (N, T + M), the cache's capacity
    mask[:, :T] = (torch.arange(T)[None, :] >= (T - plen_t)[:, None]).long()

    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return Cohort(
        owner=owner,
        keys=keys,
        topk=topk,
        matchers=matchers,
        controls=controls,
        cache=cache,
        length=T,
        mask=mask.to(device),
        logits=logits,
        prompt_len=plen_t.to(device),
        temperature=t(temp, torch.float32),
        greedy=t(greedy, torch.bool),
        top_k=t(top_k, torch.long),
        top_p=t(top_p, torch.float32),
        min_p=t(min_p, torch.float32),
        shaped=t(shaped, torch.bool),
        max_tokens=t(maxtok, torch.long),
        stop_ids=stop_t.to(device),
        uniforms=torch.stack(unif).to(device),
        stream=t(streamed, torch.bool),
        step=torch.zeros(N, dtype=torch.long, device=device),
        done=torch.zeros(N, dtype=torch.bool, device=device),
        stopped=torch.zeros(N, dtype=torch.bool, device=device),
        tokens=torch.zeros(N, W, dtype=torch.long, device=device),
        logprobs=torch.zeros(N, W, dtype=torch.float32, device=device),
        sampling_lp=torch.zeros(N, W, dtype=torch.float32, device=device),
        top_ids=torch.zeros(N, W, K, dtype=torch.long, device=device),
        top_lp=torch.zeros(N, W, K, dtype=torch.float32, device=device),
    )
