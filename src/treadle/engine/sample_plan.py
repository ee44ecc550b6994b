"""Phase 1 of DecodeBatch.add (treadle.engine.sample): the plan of its prefill rows.

One prefill row per distinct (adapter, prompt) some request needs, whichever requests share
it; a request that wants neither prompt logprobs nor new tokens needs no row at all. The
plan also collects what a row's prefill logits give its requests (prompt logprobs once per
(row, top-K), target logprobs, alternative draws) and hands them out afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treadle.engine.sample_utils import (
    alt_tokens_of_row,
    prompt_logprobs_of_row,
    target_logprobs_of_row,
)
from treadle.engine.types import SampleRequest, SampleResult


@dataclass
class _Plan:
    """The prefill rows of one add(): one per distinct (adapter, prompt)."""

    keys: list[tuple[str | None, tuple[int, ...]]]
    row_of_req: list[int]  # each request's row; -1 when it needs no model work
    topks: dict[int, set[int]]  # row → the top-K sizes its requests ask for (0: none)
    per_request: dict[int, list[int]]  # row → requests with target ids or alt draws
    generating: list[bool]  # per row: some request decodes from it
    # prompt logprobs, once per (row, top-K) even when several requests share the row
    memo: dict[tuple[int, int], tuple[list, list | None]] = field(default_factory=dict)

    def collect(
        self,
        logits: torch.Tensor,
        rows: list[int],
        T: int,
        requests: list[SampleRequest],
        results: list[SampleResult],
    ) -> None:
        """What the (len(rows), T, V) prefill logits give: prompt logprobs, target logprobs,
        alternative draws."""
        for local, r in enumerate(rows):
            prompt = self.keys[r][1]
            for k in self.topks.get(r, ()):
                self.memo[(r, k)] = prompt_logprobs_of_row(logits[local], prompt, T, k)
            for i in self.per_request.get(r, ()):
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

    def fill_prompt_logprobs(
        self, requests: list[SampleRequest], results: list[SampleResult]
    ) -> None:
        for i, req in enumerate(requests):
            if _wants_prompt_logprobs(req):
                lps, topk = self.memo[(self.row_of_req[i], req.topk_prompt_logprobs)]
                if req.prompt_logprobs:
                    results[i].prompt_logprobs = lps
                if req.topk_prompt_logprobs > 0:
                    results[i].topk_prompt_logprobs = topk


def _plan(requests: list[SampleRequest]) -> _Plan:
    row_of: dict[tuple[str | None, tuple[int, ...]], int] = {}
    row_of_req: list[int] = []
    for req in requests:
        if _wants_prompt_logprobs(req) or req.params.max_tokens > 0:
            key = (req.adapter, tuple(req.prompt))
            row_of_req.append(row_of.setdefault(key, len(row_of)))
        else:
            row_of_req.append(-1)
    plan = _Plan(list(row_of), row_of_req, {}, {}, [False] * len(row_of))
    for i, (req, r) in enumerate(zip(requests, row_of_req, strict=True)):
        if _wants_prompt_logprobs(req):
            plan.topks.setdefault(r, set()).add(req.topk_prompt_logprobs)
        if req.target_prompt_ids is not None or req.prompt_alt_tokens_k > 0:
            plan.per_request.setdefault(r, []).append(i)
        if req.params.max_tokens > 0:
            plan.generating[r] = True
    return plan


def _wants_prompt_logprobs(req: SampleRequest) -> bool:
    """Whether the request needs the prefill's logits at every prompt position."""
    return (
        req.prompt_logprobs
        or req.topk_prompt_logprobs > 0
        or req.target_prompt_ids is not None
        or req.prompt_alt_tokens_k > 0
    )
