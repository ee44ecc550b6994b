"""forward / forward_backward over the ranks of a group: each rank takes a share of the rows.

Every rank runs this with the same batches (rank 0 told them, treadle.engine.distributed):

1. all ranks check every batch (the same checks as one process, so they all refuse alike);
2. rank r takes a contiguous slice of all the rows (about 1/world of the tokens: `share`)
   and runs the model over it, each row routed to its session's adapter; a batch may be cut
   between ranks, and since every loss is a sum over tokens, its loss is the sum of the
   ranks' partial losses (one all-reduce of the partial losses, which also carries a flag
   for a rank that failed);
3. for every batch whose loss is finite, each rank takes the gradients of its partial losses,
   and one all-reduce sums them: each adapter gets exactly the gradients one process would
   compute on the whole batch, and the rule that a batch adds nothing to its adapter unless
   the result is finite is then applied to the summed gradients, on every rank alike
   (treadle.engine.train.add_or_blame), so the decision is the same everywhere;
4. the per-datum logprobs are gathered to rank 0, which builds the results.

Gradients are taken per batch, not per adapter: each batch's rows are routed to a view of
its adapter's tensors of their own (an "alias"), so one backward gives every batch's
gradients apart, and an adapter with several batches in the call whose sum is not finite
can drop just the bad ones, as one process does.

Under FSDP (treadle.engine.fsdp) every rank must run the same sequence of collectives: each
rank makes exactly one model call (one row of one token when its share is empty) and, when
any batch trains, exactly one backward that reaches the input embeddings, whatever layers
its own rows' adapters train.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from treadle.engine.logprobs import final_hidden
from treadle.engine.lora import Adapter, AdapterBank
from treadle.engine.losses import validate_batch
from treadle.engine.train import NONFINITE, _batch_loss, add_or_blame, model_pass
from treadle.engine.train_passes import aliased
from treadle.engine.types import TrainBatch, TrainResult


def share(weights: list[int], rank: int, world: int) -> tuple[int, int]:
    """Rank's contiguous slice [lo, hi) of items weighted by `weights`: an item goes to the
    rank whose 1/world of the total holds the item's middle. Empty for some rank when an
    item outweighs the others."""
    total = sum(weights)
    if total == 0:
        per = -(-len(weights) // world)
        return min(rank * per, len(weights)), min((rank + 1) * per, len(weights))
    middles = [c - w / 2 for c, w in zip(itertools.accumulate(weights), weights, strict=True)]

    def cut(k: int) -> int:
        return len(weights) if k >= world else bisect.bisect_left(middles, total * k / world)

    return cut(rank), cut(rank + 1)


def forward_backward(
    engine: Any, comm: Any, batches: list[TrainBatch], forward_only: bool
) -> list[TrainResult]:
    """Rank 0: the results of every batch, as Engine.forward_backward; other ranks: [].

    `engine` is this rank's Engine, `comm` its DistributedEngine (the group and its
    collectives)."""
    bank: AdapterBank = engine.bank
    for batch in batches:
        validate_batch(batch, engine.vocab_size, engine.max_seq_len)
        bank.get(batch.adapter_id) if forward_only else bank.live(batch.adapter_id)
    if not batches:
        return []
    fsdp = comm.group.fsdp
    lengths = [len(d.tokens) for b in batches for d in b.data]
    lo, hi = share(lengths, comm.group.rank, comm.group.world)
    local = _local_batches(batches, lo, hi)
    train = not forward_only
    partial: dict[int, torch.Tensor] = {}
    outs: dict[int, list[dict[str, np.ndarray]]] = {}
    failure: BaseException | None = None
    anchor: torch.Tensor | None = None
    leaf: list[torch.Tensor] = []
    with torch.set_grad_enabled(train), aliased(bank, batches, train) as aliases:
        try:
            keys = [aliases[i].id if train else b.adapter_id for i, b in local for _ in b.data]
            tokens = len(lengths) * max(lengths)  # the whole call's: every rank decides alike
            plan = getattr(engine, "memory_plan", None)
            checkpointed = plan is not None and plan.checkpoints(tokens, train)
            partial, outs, anchor = _pass(
                engine, local, keys, fsdp, leaf if fsdp and train else None, checkpointed
            )
        except Exception as e:  # noqa: BLE001 - reported through the all-reduce below
            failure = e
    # the whole batches' losses, and whether any rank failed, in one all-reduce
    vec = torch.zeros(len(batches) + 1, dtype=torch.float32, device=engine.device)
    for i, loss in partial.items():
        vec[i] = loss.detach().float()
    vec[-1] = float(failure is not None)
    comm.all_reduce(vec)
    if vec[-1].item() > 0:
        comm.raise_failures(failure)
    values = vec[:-1].tolist()
    bad = [not math.isfinite(v) for v in values]
    if train and not all(bad):
        bad = _accumulate(engine, comm, batches, partial, aliases, bad, anchor, leaf)
    gathered = comm.gather([(i, outs[i]) for i, _ in local])
    if gathered is None:
        return []
    outputs: list[list[dict[str, np.ndarray]]] = [[] for _ in batches]
    for part in gathered:
        for i, o in part:
            outputs[i] += o
    return [
        TrainResult(out, {"loss:sum": value, NONFINITE: float(b)})
        for out, value, b in zip(outputs, values, bad, strict=True)
    ]


def _local_batches(batches: list[TrainBatch], lo: int, hi: int) -> list[tuple[int, TrainBatch]]:
    """The rows [lo, hi) of all batches: (batch index, that batch cut to its rows there)."""
    local, row = [], 0
    for i, b in enumerate(batches):
        a, z = max(lo, row), min(hi, row + len(b.data))
        if a < z:
            local.append((i, dataclasses.replace(b, data=b.data[a - row : z - row])))
        row += len(b.data)
    return local


def _pass(
    engine: Any,
    local: list[tuple[int, TrainBatch]],
    keys: list[str],
    fsdp: bool,
    leaf: list[torch.Tensor] | None,
    checkpointed: bool = False,
) -> tuple[dict[int, torch.Tensor], dict[int, list[dict[str, np.ndarray]]], torch.Tensor | None]:
    """The model over this rank's rows → partial losses and outputs by batch index, and a
    backward anchor for FSDP (the final hidden states and the head's output, both zero
    in the objective). `leaf` receives the input embeddings as a tensor that requires
    grad (FSDP: the backward then crosses every layer)."""
    if not local and not fsdp:
        return {}, {}, None
    model = engine.model
    kept: list[torch.Tensor] = []
    partial, outs = {}, {}
    with _embeddings_as_leaf(model, leaf):
        if local:
            lps, targets, lengths = model_pass(
                model,
                engine.bank,
                [b for _, b in local],
                keys,
                getattr(engine, "layer_checkpointing", None),
                checkpointed,
                kept,
            )
        else:  # an empty share under FSDP: one base row of token 0
            ids = torch.zeros((1, 1), dtype=torch.long, device=engine.device)
            with engine.bank.rows([None]), final_hidden(model) as hidden:
                logits = model(input_ids=ids, use_cache=False).logits  # (1, 0, V)
            kept += [hidden[0], logits]
            lps, targets, lengths = [], [], []
    start = 0
    for (i, b), lp, target in zip(local, lps, targets, strict=True):
        stop = start + len(b.data)
        partial[i], outs[i] = _batch_loss(lp, b, lengths[start:stop], target)
        start = stop
    anchor = kept[0].sum() + kept[1].sum() if fsdp else None
    return partial, outs, anchor


@contextlib.contextmanager
def _embeddings_as_leaf(model: torch.nn.Module, leaf: list[torch.Tensor] | None) -> Iterator[None]:
    if leaf is None:
        yield
        return

    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.detach().requires_grad_(True)  # (B, T, H)
        leaf.append(out)
        return out

    handle = model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _accumulate(
    engine: Any,
    comm: Any,
    batches: list[TrainBatch],
    partial: dict[int, torch.Tensor],
    aliases: dict[int, Adapter],
    bad: list[bool],
    anchor: torch.Tensor | None,
    leaf: list[torch.Tensor],
) -> list[bool]:
    """Sum each finite batch's gradients over the ranks, then add them to its adapter's
    .grad where the result stays finite (train._accumulate's rule, on the summed
    gradients). Returns `bad` with the batches that added nothing marked."""
    bad = list(bad)
    good = [i for i in range(len(batches)) if not bad[i]]
    targets = [t for i in good for t in aliases[i].parameters()]
    objective = None
    for i in good:
        if i in partial:
            objective = partial[i] if objective is None else objective + partial[i]
    if anchor is not None:  # FSDP: a backward on every rank, through every layer
        zero = anchor * 0.0
        objective = zero if objective is None else objective + zero
    failure: BaseException | None = None
    grads: list[torch.Tensor | None] = [None] * len(targets)
    try:
        if objective is not None and objective.requires_grad:
            found = torch.autograd.grad(objective, targets + leaf, allow_unused=True)
            grads = list(found[: len(targets)])
    except Exception as e:  # noqa: BLE001 - reported through the all-reduce below
        failure = e
    flat = torch.cat(
        [
            (g if g is not None else torch.zeros_like(t)).reshape(-1)
            for g, t in zip(grads, targets, strict=True)
        ]
        + [torch.tensor([float(failure is not None)], device=engine.device)]
    )
    comm.all_reduce(flat)
    if flat[-1].item() > 0:
        comm.raise_failures(failure)
    summed = list(flat[:-1].split([t.numel() for t in targets]))
    per_batch: dict[int, tuple[torch.Tensor, ...]] = {}
    for i in good:
        n = len(aliases[i].layers) * 2
        per_batch[i] = tuple(  # copies: a .grad must not hold the whole buffer
            g.view_as(t).clone() for g, t in zip(summed[:n], aliases[i].parameters(), strict=True)
        )
        summed = summed[n:]
    of_adapter: dict[str, list[int]] = {}
    for i in good:
        of_adapter.setdefault(batches[i].adapter_id, []).append(i)
    for adapter_id, ids in of_adapter.items():
        adapter = engine.bank.live(adapter_id)
        together = per_batch[ids[0]]
        for i in ids[1:]:
            together = tuple(a + b for a, b in zip(together, per_batch[i], strict=True))
        add_or_blame(adapter, together, ids, per_batch.__getitem__, bad)
    return bad
