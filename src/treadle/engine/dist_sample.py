"""Sampling over the ranks of a group: each rank decodes a share of the requests.

Every rank runs this with the same requests (rank 0 told them): all check every request
first (so they refuse alike), rank r samples its contiguous share (about 1/world of the
work, counted as num_samples x (prompt + max_tokens)) with the ordinary sampler
(Engine.sample), and rank 0 gathers the results in order. A request's random draws come
from its own seed (treadle.engine.sample), so the same seeds give the same tokens as one
process, wherever the request lands.

Under FSDP every model call all-gathers each layer's weights, a collective, so the ranks
must make the same number of calls although their shares decode for different numbers of
steps: before each model call a rank votes "still going" (`lockstep`); a rank whose share
is done keeps voting "done" and makes a call on one token of its own until every rank is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from treadle.engine.sample_utils import validate_request
from treadle.engine.train_passes import share
from treadle.engine.types import SampleRequest, SampleResult


def sample(engine: Any, comm: Any, requests: list[SampleRequest]) -> list[SampleResult]:
    """Rank 0: one result per request, as Engine.sample; other ranks: []."""
    for i, req in enumerate(requests):
        validate_request(engine, req, i)
    costs = [r.num_samples * (len(r.prompt) + r.params.max_tokens) for r in requests]
    lo, hi = share(costs, comm.rank, comm.world)
    mine = requests[lo:hi]
    results: list[SampleResult] = []
    failure: BaseException | None = None
    with lockstep(engine, comm) if comm.fsdp else contextlib.nullcontext():
        try:
            results = engine.sample(mine) if mine else []
        except Exception as e:  # noqa: BLE001 - every rank hears of it below
            failure = e
    comm.raise_failures(failure)
    gathered = comm.gather(results)
    return [] if gathered is None else [r for part in gathered for r in part]


@contextlib.contextmanager
def lockstep(engine: Any, comm: Any) -> Iterator[None]:
    """Make every rank's model calls inside the block line up one for one (FSDP)."""
    model = engine.model
    draining = False

    def before(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not draining:
            comm.vote(1)

    # prepended: the vote comes before FSDP's own pre-forward all-gather
    handle = model.register_forward_pre_hook(before, prepend=True, with_kwargs=True)
    try:
        yield
    finally:
        draining = True
        try:
            one = torch.zeros((1, 1), dtype=torch.long, device=engine.device)  # (1, 1)
            while comm.vote(0):
                with torch.inference_mode(), engine.bank.rows([None]):
                    model(input_ids=one, use_cache=False, logits_to_keep=1)
        finally:
            handle.remove()
