"""A forward / forward_backward call too large for one pass within the memory budget runs as
several passes over consecutive rows (treadle.engine.memory says what one pass holds).

A batch may be cut between passes; since every loss is a sum over tokens, its loss is the
sum of its pieces' losses and its gradients the sum of theirs. Each batch's rows are routed
to an alias of its adapter (views of the adapter's tensors, registered for the call only),
so each pass's one backward gives every batch's gradients apart; they are summed per batch
over the passes, and only then does the rule of one pass apply: a batch adds its gradients
to its adapter only if its loss and the result are finite (train.add_or_blame), whatever
pass held which of its rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import uuid
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from treadle.engine import train
from treadle.engine.checkpointing import LayerCheckpointing
from treadle.engine.lora import Adapter, AdapterBank, LoraPair
from treadle.engine.memory import MemoryPlan
from treadle.engine.types import TrainBatch, TrainResult

Piece = tuple[int, TrainBatch]  # (batch index, some consecutive rows of that batch)


def plan_passes(batches: list[TrainBatch], plan: MemoryPlan, train_: bool) -> list[list[Piece]]:
    """Consecutive rows, as many per pass as fit (rows x longest row <= the budget's)."""
    passes: list[list[Piece]] = []
    current: list[tuple[int, int]] = []  # (batch, row) of the pass being filled
    longest = 0
    for i, batch in enumerate(batches):
        for r, datum in enumerate(batch.data):
            T = max(longest, len(datum.tokens))
            if current and not plan.fits((len(current) + 1) * T, train_):
                passes.append(_pieces(batches, current))
                current, T = [], len(datum.tokens)
            current.append((i, r))
            longest = T
    passes.append(_pieces(batches, current))
    return passes


def _pieces(batches: list[TrainBatch], rows: list[tuple[int, int]]) -> list[Piece]:
    out: list[Piece] = []
    for i in dict.fromkeys(b for b, _ in rows):
        idx = [r for b, r in rows if b == i]
        src = batches[i]
        part = src.data[idx[0] : idx[-1] + 1]
        out.append((i, dataclasses.replace(src, data=part)))
    return out


def run_passes(
    model: nn.Module,
    bank: AdapterBank,
    batches: list[TrainBatch],
    passes: list[list[Piece]],
    train_: bool,
    plan: MemoryPlan,
    layers: LayerCheckpointing | None,
) -> list[TrainResult]:
    """The results of train.forward_backward, pass by pass (see the module doc)."""
    n = len(batches)
    values = [0.0] * n
    outputs: list[list[dict[str, np.ndarray]]] = [[] for _ in batches]
    grads: dict[int, list[torch.Tensor | None]] = {}
    with aliased(bank, batches, train_) as aliases:
        for pieces in passes:
            keys = [aliases[i].id if train_ else b.adapter_id for i, b in pieces for _ in b.data]
            tokens = len(keys) * max(len(d.tokens) for _, b in pieces for d in b.data)
            checkpointed = plan.checkpoints(tokens, train_)
            part: dict[int, torch.Tensor] = {}
            with torch.set_grad_enabled(train_):
                lps, targets, lengths = train.model_pass(
                    model, bank, [b for _, b in pieces], keys, layers, checkpointed
                )
                start = 0
                for (i, b), lp, target in zip(pieces, lps, targets, strict=True):
                    stop = start + len(b.data)
                    part[i], outs = train._batch_loss(lp, b, lengths[start:stop], target)
                    outputs[i] += outs
                    start = stop
            sums = torch.stack([x.detach() for x in part.values()]).tolist()  # one host sync
            found = dict(zip(part, sums, strict=True))
            for i, v in found.items():
                values[i] += v
            if train_:
                _add_pass_grads(part, found, aliases, grads)
    bad = [not math.isfinite(v) for v in values]
    if train_:
        of_adapter: dict[str, list[int]] = {}
        for i in range(n):
            if not bad[i]:
                of_adapter.setdefault(batches[i].adapter_id, []).append(i)
        for adapter_id, ids in of_adapter.items():
            adapter = bank.live(adapter_id)
            own = {i: _filled(grads.get(i), aliases[i]) for i in ids}
            together = own[ids[0]]
            for i in ids[1:]:
                together = tuple(a + b for a, b in zip(together, own[i], strict=True))
            train.add_or_blame(adapter, together, ids, own.__getitem__, bad)
    return [
        TrainResult(out, {"loss:sum": value, train.NONFINITE: float(b)})
        for out, value, b in zip(outputs, values, bad, strict=True)
    ]


def _add_pass_grads(
    part: dict[int, torch.Tensor],
    found: dict[int, float],
    aliases: dict[int, Adapter],
    grads: dict[int, list[torch.Tensor | None]],
) -> None:
    """One backward over this pass's finite pieces; each batch's gradients added to its sum
    (a batch with a non-finite piece is bad already: its gradients are never used)."""
    live = [i for i, v in found.items() if math.isfinite(v)]
    if not live:
        return
    objective = part[live[0]]
    for i in live[1:]:
        objective = objective + part[i]
    if not objective.requires_grad:
        return
    params = [t for i in live for t in aliases[i].parameters()]
    got = torch.autograd.grad(objective, params, allow_unused=True)
    start = 0
    for i in live:
        k = len(aliases[i].layers) * 2
        mine, start = got[start : start + k], start + k
        prev = grads.get(i)
        grads[i] = (
            list(mine) if prev is None else [_sum(a, b) for a, b in zip(prev, mine, strict=True)]
        )


def _sum(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


def _filled(got: list[torch.Tensor | None] | None, alias: Adapter) -> tuple:
    """A batch's summed gradients, zeros where no pass gave it any."""
    params = alias.parameters()
    got = got or [None] * len(params)
    return tuple(torch.zeros_like(p) if g is None else g for g, p in zip(got, params, strict=True))


@contextlib.contextmanager
def aliased(bank: AdapterBank, batches: list[TrainBatch], train_: bool) -> Iterator[dict]:
    """Per batch, an adapter whose tensors are views of its adapter's (registered as a
    snapshot for the routing, for the model calls of this context): the gradients of each
    view are that batch's alone."""
    if not train_:
        yield {}
        return
    tag = uuid.uuid4().hex[:8]
    aliases = {}
    for i, b in enumerate(batches):
        src = bank.live(b.adapter_id)
        layers = {
            path: LoraPair(p.A.view_as(p.A), p.B.view_as(p.B), p.scale)
            for path, p in src.layers.items()
        }
        aliases[i] = Adapter(f"{b.adapter_id}#{tag}.{i}", src.spec, layers, trainable=False)
    bank.snapshots.update({a.id: a for a in aliases.values()})
    try:
        yield aliases
    finally:
        for a in aliases.values():
            bank.snapshots.pop(a.id, None)
