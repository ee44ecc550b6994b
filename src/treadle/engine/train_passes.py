"""The passes of a forward / forward_backward call: which rows each rank and each model pass
takes, and one pass's forward and backward (the call itself: treadle.engine.train).

Rows are split twice, always into consecutive rows:
1. across the ranks of a group (`share`): rank r takes about 1/world of the tokens; one
   process is the group of one and takes them all;
2. across passes (`split_passes`): a rank's rows that do not fit one pass within the
   memory budget (treadle.engine.memory) run as several, as many rows per pass as fit.

A batch may be cut between ranks and between passes. Since every loss is a sum over tokens,
its loss is the sum of its pieces' losses and its gradients the sum of theirs. Each batch's
rows are routed to an alias of its adapter (views of the adapter's tensors, registered for
the call only), so each pass's one backward gives every batch's gradients apart.

Under FSDP (treadle.engine.fsdp) every model call and every backward is a collective, so all
ranks make the same passes: as many as the rank with most (an empty pass is one base row of
token 0), each checkpointed where any rank's is, and, when training, one backward per pass
that reaches the input embeddings whatever layers the rank's own rows train.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from treadle.engine import train
from treadle.engine.logprobs import final_hidden
from treadle.engine.lora import Adapter, AdapterBank, LoraPair
from treadle.engine.memory import MemoryPlan
from treadle.engine.types import TrainBatch

Piece = tuple[int, TrainBatch]  # (batch index, some consecutive rows of that batch)


@dataclass
class Pass:
    """One model pass of one rank: its pieces (none: an FSDP rank's empty pass)."""

    pieces: list[Piece]
    checkpointed: bool


@dataclass
class Ran:
    """What a pass's forward gave: each piece's loss, its value and its outputs, by batch
    index; under FSDP training, what its backward must reach (`anchor`, `leaf`)."""

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, float] = field(default_factory=dict)
    outputs: dict[int, list[dict[str, np.ndarray]]] = field(default_factory=dict)
    anchor: torch.Tensor | None = None
    leaf: list[torch.Tensor] = field(default_factory=list)


# ---- which rows ----
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


def local_rows(batches: list[TrainBatch], lo: int, hi: int) -> list[Piece]:
    """The rows [lo, hi) of all batches, as pieces (a batch held whole is itself)."""
    local, row = [], 0
    for i, b in enumerate(batches):
        a, z = max(lo, row), min(hi, row + len(b.data))
        if a < z:
            local.append((i, _rows(b, a - row, z - row)))
        row += len(b.data)
    return local


def _rows(batch: TrainBatch, lo: int, hi: int) -> TrainBatch:
    if lo == 0 and hi == len(batch.data):
        return batch
    return dataclasses.replace(batch, data=batch.data[lo:hi])  # its custom loss too


def plan_passes(batches: list[TrainBatch], plan: MemoryPlan, train_: bool) -> list[list[Piece]]:
    """The passes of one process over all of `batches` (split_passes of them all)."""
    return split_passes(list(enumerate(batches)), plan, train_)


def split_passes(pieces: list[Piece], plan: MemoryPlan | None, train_: bool) -> list[list[Piece]]:
    """Consecutive rows of `pieces`, as many per pass as fit (rows x longest row <= the
    budget's); all in one pass without a plan; no pass without rows."""
    if not pieces:
        return []
    if plan is None:
        return [pieces]
    passes: list[list[Piece]] = []
    current: list[tuple[int, int]] = []  # (piece, row) of the pass being filled
    longest = 0
    for k, (_, batch) in enumerate(pieces):
        for r, datum in enumerate(batch.data):
            T = max(longest, len(datum.tokens))
            if current and not plan.fits((len(current) + 1) * T, train_):
                passes.append(_cut(pieces, current))
                current, T = [], len(datum.tokens)
            current.append((k, r))
            longest = T
    passes.append(_cut(pieces, current))
    return passes


def _cut(pieces: list[Piece], rows: list[tuple[int, int]]) -> list[Piece]:
    """The rows (piece, row), consecutive, as one piece per piece they come from."""
    out: list[Piece] = []
    for k, run in itertools.groupby(rows, key=lambda kr: kr[0]):
        rs = [r for _, r in run]
        i, batch = pieces[k]
        out.append((i, _rows(batch, rs[0], rs[-1] + 1)))
    return out


def rank_passes(
    batches: list[TrainBatch], plan: MemoryPlan | None, train_: bool, comm: Any
) -> list[Pass]:
    """This rank's passes over its share of the rows (see the module doc for FSDP)."""
    lengths = [len(d.tokens) for b in batches for d in b.data]

    def passes_of(rank: int) -> list[Pass]:
        lo, hi = share(lengths, rank, comm.world)
        split = split_passes(local_rows(batches, lo, hi), plan, train_)
        return [Pass(pieces, _checkpointed(pieces, plan, train_)) for pieces in split]

    mine = passes_of(comm.rank)
    if not comm.fsdp:
        return mine
    every = [mine if r == comm.rank else passes_of(r) for r in range(comm.world)]
    return [
        Pass(
            mine[k].pieces if k < len(mine) else [],
            any(p[k].checkpointed for p in every if k < len(p)),
        )
        for k in range(max(len(p) for p in every))
    ]


def _checkpointed(pieces: list[Piece], plan: MemoryPlan | None, train_: bool) -> bool:
    if plan is None:
        return False
    rows = [len(d.tokens) for _, b in pieces for d in b.data]
    return plan.checkpoints(len(rows) * max(rows), train_)


# ---- one pass ----
def forward(engine: Any, p: Pass, aliases: dict[int, Adapter], train_: bool, fsdp: bool) -> Ran:
    """The model over the pass's rows (each routed to its batch's alias when training):
    each piece's loss (summed over its tokens), value and per-datum logprobs."""
    model, bank = engine.model, engine.bank
    layers = getattr(engine, "layer_checkpointing", None)
    ran = Ran()
    kept: list[torch.Tensor] = []
    with _embeddings_as_leaf(model, ran.leaf if fsdp and train_ else None):
        if p.pieces:
            keys = [aliases[i].id if train_ else b.adapter_id for i, b in p.pieces for _ in b.data]
            lps, targets, lengths = train.model_pass(
                model, bank, [b for _, b in p.pieces], keys, layers, p.checkpointed,
                kept if fsdp else None,
            )  # fmt: skip
        else:  # an empty pass under FSDP: one base row of token 0
            ids = torch.zeros((1, 1), dtype=torch.long, device=engine.device)  # (1, 1)
            switch = layers.enabled(p.checkpointed) if layers else contextlib.nullcontext()
            with bank.rows([None]), switch, final_hidden(model) as hidden:
                logits = model(input_ids=ids, use_cache=False).logits  # (1, 0, V)
            kept += [hidden[0], logits]
            lps, targets, lengths = [], [], []
    start = 0
    for (i, b), lp, target in zip(p.pieces, lps, targets, strict=True):
        stop = start + len(b.data)
        ran.losses[i], ran.outputs[i] = train._batch_loss(lp, b, lengths[start:stop], target)
        start = stop
    if ran.losses:  # one host sync
        sums = torch.stack([x.detach() for x in ran.losses.values()]).tolist()
        ran.values = dict(zip(ran.losses, sums, strict=True))
    if fsdp and train_:
        ran.anchor = kept[0].sum() + kept[1].sum()
    return ran


def backward(ran: Ran, aliases: dict[int, Adapter], grads: dict[int, list]) -> None:
    """One backward over the pass's finite pieces: each batch's gradients added to its sum
    over passes (a batch with a non-finite piece is bad already: never used)."""
    live = [i for i, v in ran.values.items() if math.isfinite(v)]
    objective = None
    for i in live:
        objective = ran.losses[i] if objective is None else objective + ran.losses[i]
    if ran.anchor is not None:  # FSDP: a backward on every rank, through every layer
        zero = ran.anchor * 0.0
        objective = zero if objective is None else objective + zero
    if objective is None or not objective.requires_grad:
        return
    params = [t for i in live for t in aliases[i].parameters()]
    got = torch.autograd.grad(objective, params + ran.leaf, allow_unused=True)
    start = 0
    for i in live:
        k = len(aliases[i].layers) * 2
        mine, start = got[start : start + k], start + k
        prev = grads.get(i)
        grads[i] = list(mine) if prev is None else list(map(_sum, prev, mine))


def _sum(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


def filled(got: list[torch.Tensor | None] | None, alias: Adapter) -> list[torch.Tensor]:
    """A batch's summed gradients, zeros where no pass of this rank gave it any."""
    params = alias.parameters()
    got = got or [None] * len(params)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(got, params, strict=True)]


@contextlib.contextmanager
def _embeddings_as_leaf(model: torch.nn.Module, leaf: list[torch.Tensor] | None) -> Iterator[None]:
    """`leaf` receives the input embeddings as a tensor that requires grad (FSDP: the
    backward then crosses every layer)."""
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
