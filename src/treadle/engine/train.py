"""forward / forward_backward over the batches of several sessions, on one process or on the
ranks of a group: one code path, in which one process is the group of one (the optimizer
step is treadle.engine.optim).

All rows of all batches go through the model together, right-padded to the longest, each
row routed to its session's adapter (AdapterBank.rows). Each rank of a group (rank 0 told
them all the same batches: treadle.engine.distributed) runs the same call:

1. every rank checks every batch (the same checks, so they all refuse alike);
2. it takes its share of the rows, in as many passes as the memory budget asks for
   (treadle.engine.train_passes; one process: all rows, usually in one pass); each pass
   is one model call and, when training, one backward over its pieces' finite losses,
   each batch's rows routed to an alias of its adapter, so that every batch gets its own
   gradients;
3. the batches' losses are summed over the ranks, with a flag for a rank that failed
   (`comm.sum_values`: one all-reduce; one process: the values themselves);
4. each batch whose loss is finite has its gradients summed over the ranks
   (`comm.sum_tensors`), and they are added to its adapter's .grad only if the result stays
   finite (`add_or_blame`), on every rank alike: each adapter receives exactly the gradient
   of its own batches, as one pass of one process would give it; gradients accumulate in
   .grad until that adapter's optim_step;
5. the per-datum logprobs are gathered to rank 0, which builds the results.

Containment: one tenant's numbers never leak into another's. A batch whose loss or new
gradients are not finite adds nothing to its adapter (its result carries `nonfinite:sum` 1),
and an optim_step that would leave an adapter non-finite is refused (treadle.engine.optim).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from treadle.engine.checkpointing import LayerCheckpointing, route_replay
from treadle.engine.logprobs import (
    ContextFn,
    Transform,
    final_hidden,
    logit_transform,
    target_logprobs,
)
from treadle.engine.lora import Adapter, AdapterBank, tensor_peaks
from treadle.engine.lora_adapters import UNEMBED
from treadle.engine.losses import CLIP_DEFAULTS, FLOAT_KEYS, LOSSES, as_int64, validate_batch
from treadle.engine.specs import check_fit
from treadle.engine.types import TrainBatch, TrainResult

# Metric of every forward / forward_backward result: 1.0 when the batch's loss, or the
# gradients it would add to its adapter (alone or accumulated), were not finite, so that it
# added nothing (forward only: when its loss is not finite); 0.0 otherwise.
NONFINITE = "nonfinite:sum"


def forward_backward(
    engine: Any, comm: Any, batches: list[TrainBatch], forward_only: bool = False
) -> list[TrainResult]:
    """Logprobs and loss of every batch; gradients into each adapter unless forward_only.
    Rank 0 (one process: the process) gets the results, the other ranks [].

    `engine` gives model, bank, vocab_size, max_seq_len, device, and optionally
    memory_plan and layer_checkpointing (treadle.engine.memory: a sequence longer than any
    pass holds is refused before anything is allocated; layers are checkpointed where the
    plan says so); `comm` is the ranks' communicator (treadle.engine.comm: ONE_RANK for one
    process). forward_only also accepts snapshot ids; forward_backward needs live adapters.
    Metrics: `loss:sum` and NONFINITE; a non-finite batch leaves its adapter's gradients as
    they were and the other batches of the call exactly as if it had not been there.
    """
    from treadle.engine import train_passes as passes  # it builds on this module

    bank: AdapterBank = engine.bank
    for batch in batches:
        validate_batch(batch, engine.vocab_size, engine.max_seq_len)
        bank.get(batch.adapter_id) if forward_only else bank.live(batch.adapter_id)
    if not batches:
        return []
    train = not forward_only
    plan = getattr(engine, "memory_plan", None)
    if plan is not None:
        lengths = [len(d.tokens) for b in batches for d in b.data]
        check_fit(lengths, plan.longest(train), plan.describe(train), "datum {i}: ")
    mine = passes.rank_passes(batches, plan, train, comm)
    values = [0.0] * len(batches)  # this rank's part of each batch's loss
    outputs: dict[int, list[dict[str, np.ndarray]]] = {}
    grads: dict[int, list[torch.Tensor | None]] = {}
    failure: BaseException | None = None
    with torch.set_grad_enabled(train), passes.aliased(bank, batches, train) as aliases:
        for k, p in enumerate(mine):
            last = k == len(mine) - 1
            try:
                ran = passes.forward(engine, p, aliases, train, comm.fsdp)
                for i, v in ran.values.items():
                    values[i] += v
                    outputs.setdefault(i, []).extend(ran.outputs[i])
            except Exception as e:  # noqa: BLE001 - every rank hears of it below
                failure = e
            if _stop(comm, failure, more=train or not last):
                break
            if train:
                try:
                    passes.backward(ran, aliases, grads)
                except Exception as e:  # noqa: BLE001
                    failure = e
                if _stop(comm, failure, more=not last):
                    break
            del ran
    totals, failed = comm.sum_values(values, failure is not None)
    if failed:
        comm.raise_failures(failure)
    bad = [not math.isfinite(v) for v in totals]
    if train and not all(bad):
        good = [i for i in range(len(batches)) if not bad[i]]
        held = [passes.filled(grads.get(i), aliases[i]) for i in good]
        summed = comm.sum_tensors([g for gs in held for g in gs])
        per_batch: dict[int, tuple[torch.Tensor, ...]] = {}
        start = 0
        for i, gs in zip(good, held, strict=True):
            per_batch[i], start = tuple(summed[start : start + len(gs)]), start + len(gs)
        _accumulate(bank, batches, per_batch, bad)
    gathered = comm.gather(list(outputs.items()))
    if gathered is None:
        return []
    merged: list[list[dict[str, np.ndarray]]] = [[] for _ in batches]
    for part in gathered:
        for i, outs in part:
            merged[i] += outs
    return [
        TrainResult(outs, {"loss:sum": value, NONFINITE: float(b)})
        for outs, value, b in zip(merged, totals, bad, strict=True)
    ]


def _stop(comm: Any, failure: BaseException | None, more: bool) -> bool:
    """Whether this rank stops its passes after a failure. Under FSDP, when another
    collective follows, the ranks vote: all stop together, or a rank that stopped alone
    would leave the others waiting in their next model call."""
    if comm.fsdp and more:
        return bool(comm.vote(int(failure is not None)))
    return failure is not None


def _accumulate(
    bank: AdapterBank,
    batches: list[TrainBatch],
    per_batch: dict[int, tuple[torch.Tensor, ...]],
    bad: list[bool],
) -> None:
    """Add each finite batch's (summed) gradients to its adapter's .grad where the result
    stays finite; the batches that added nothing are marked in `bad`."""
    of_adapter: dict[str, list[int]] = {}
    for i in per_batch:
        of_adapter.setdefault(batches[i].adapter_id, []).append(i)
    for adapter_id, ids in of_adapter.items():
        together = per_batch[ids[0]]
        for i in ids[1:]:
            together = tuple(a + b for a, b in zip(together, per_batch[i], strict=True))
        add_or_blame(bank.live(adapter_id), together, ids, per_batch.__getitem__, bad)


def model_pass(
    model: nn.Module,
    bank: AdapterBank,
    batches: list[TrainBatch],
    keys: list[str | None],
    layers: LayerCheckpointing | None = None,
    checkpointed: bool = False,
    hidden_out: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[_Targets], list[int]]:
    """The model over the rows of `batches` (row i routed to keys[i]) → each batch's target
    logprobs, its targets and every row's length. The logits are never whole: the model
    runs without its head and the head is applied chunk by chunk (treadle.engine.logprobs).
    hidden_out receives the final hidden states (B, T, H) and the head's (B, 0, V) output,
    for a caller whose backward must cross every layer (FSDP)."""
    device = next(model.parameters()).device
    lengths = [len(d.tokens) for b in batches for d in b.data]
    n_rows, T = len(lengths), max(lengths)
    ids = np.zeros((n_rows, T), dtype=np.int64)  # (B, T); pads are token 0, masked out below
    row = 0
    for batch in batches:
        for datum in batch.data:
            ids[row, : len(datum.tokens)] = as_int64(datum.tokens)
            row += 1
    head = model.get_output_embeddings()
    switch = layers.enabled(checkpointed) if layers is not None else contextlib.nullcontext()
    # No attention mask: rows are right padded and attention is causal, so a real token
    # never attends to a pad (the same numbers as with the mask, without its (B, T, T))
    with bank.rows(keys), switch:
        with final_hidden(model) as kept:
            out = model(input_ids=torch.from_numpy(ids).to(device), use_cache=False)
        hidden = kept[-1]  # (B, T, H)
        lps, targets = _logprobs(
            head,
            hidden,
            batches,
            logit_transform(model.config),
            route_replay(bank),
            _plain_head(bank, keys),
        )
    if hidden_out is not None:
        hidden_out += [hidden, out.logits]
    return lps, targets, lengths


def _plain_head(bank: AdapterBank, keys: list[str | None]) -> bool:
    """Whether no row has a LoRA on the unembedding (a fused kernel may then read it)."""
    heads = [path for path, kind in bank.targets.items() if kind == UNEMBED]
    return not any(p in bank.get(k).layers for k in set(keys) if k is not None for p in heads)


def add_or_blame(
    adapter: Adapter,
    together: tuple[torch.Tensor | None, ...],
    ids: list[int],
    alone: Callable[[int], tuple[torch.Tensor | None, ...]],
    bad: list[bool],
) -> None:
    """Add the summed gradients of an adapter's batches `ids` if the result stays finite;
    if not, find which batches are to blame (each one's own gradients from `alone`), add
    the others and mark those in `bad`."""
    if _add_if_finite(adapter, together):
        return
    if len(ids) == 1:
        bad[ids[0]] = True
        return
    for i in ids:  # rare: find which of the adapter's batches are to blame
        bad[i] = not _add_if_finite(adapter, alone(i))


def _add_if_finite(adapter: Adapter, grads: tuple[torch.Tensor | None, ...]) -> bool:
    """.grad += grads (as .backward() accumulates) unless a result would not be finite."""
    params = adapter.parameters()
    sums = [
        None if g is None else g if p.grad is None else p.grad + g
        for p, g in zip(params, grads, strict=True)
    ]
    if not all(math.isfinite(v) for v in tensor_peaks([t for t in sums if t is not None])):
        return False
    for p, t in zip(params, sums, strict=True):
        if t is not None:
            p.grad = t
    return True


@dataclass
class _Targets:
    """One batch's target tokens: as sent, and padded to the call's (n, T) or (n, T, K)."""

    sent: list[np.ndarray]
    padded: torch.Tensor
    top_k: bool  # some datum sends (T_i, K_i) targets: K logprobs per position


def _targets(batch: TrainBatch, T: int, device: torch.device) -> _Targets:
    sent = [as_int64(d.loss_inputs["target_tokens"]) for d in batch.data]
    top_k = any(t.ndim == 2 for t in sent)
    K = max((t.shape[1] for t in sent if t.ndim == 2), default=1)
    return _Targets(sent, _pad(sent, len(sent), T, K if top_k else None, np.int64, device), top_k)


def _pad(
    values: list, n: int, T: int, K: int | None, dtype: type, device: torch.device
) -> torch.Tensor:
    """Each datum's (T_i,) or (T_i, K_i) values in an (n, T) or (n, T, K) zero tensor."""
    out = np.zeros((n, T) if K is None else (n, T, K), dtype=dtype)
    for i, v in enumerate(values):
        v = np.asarray(v, dtype=dtype)
        if K is not None:
            v = v.reshape(v.shape[0], -1)  # (T_i, K_i): a (T,) datum is K = 1
            out[i, : v.shape[0], : v.shape[1]] = v
        else:
            out[i, : v.shape[0]] = v
    return torch.from_numpy(out).to(device)


def _logprobs(
    head: nn.Module,
    hidden: torch.Tensor,
    batches: list[TrainBatch],
    transform: Transform | None,
    context_fn: ContextFn,
    plain_head: bool,
) -> tuple[list[torch.Tensor], list[_Targets]]:
    """Each batch's target logprobs (n, T) or (n, T, K), and its targets.

    One chunked pass over the vocabulary serves every row (the head is called on all rows:
    the routing of a LoRA on it needs them); with top-k targets in some batch, every row
    gets K = the largest K columns (a (T,) datum in column 0) and each batch keeps its own.
    """
    T = hidden.shape[1]
    targets = [_targets(b, T, hidden.device) for b in batches]
    sizes = [len(b.data) for b in batches]
    K = max((t.padded.shape[2] for t in targets if t.top_k), default=0)
    if K:
        every = torch.cat([_as_k(t.padded, K) for t in targets])  # (B, T, K)
    else:
        every = torch.cat([t.padded for t in targets])  # (B, T)
    lp = target_logprobs(head, hidden, every, transform, context_fn, plain_head and not K)
    pieces = lp.split(sizes) if len(batches) > 1 else [lp]
    if K:
        pieces = [
            x[..., : t.padded.shape[2]] if t.top_k else x[..., 0]
            for x, t in zip(pieces, targets, strict=True)
        ]
    return list(pieces), targets


def _as_k(padded: torch.Tensor, K: int) -> torch.Tensor:
    """(n, T) or (n, T, k) targets as (n, T, K), zero-padded (those columns are dropped)."""
    if padded.dim() == 2:
        padded = padded[..., None]
    return F.pad(padded, (0, K - padded.shape[2]))  # (n, T, K)


def _batch_loss(
    lp: torch.Tensor, batch: TrainBatch, lengths: list[int], targets: _Targets
) -> tuple[torch.Tensor, list[dict[str, np.ndarray]]]:
    """Loss (a scalar, summed over tokens) and per-datum logprobs of one session's rows,
    from their target logprobs lp (n, T) or (n, T, K)."""
    n, T = lp.shape[:2]
    device = lp.device
    custom = batch.custom  # a server-side custom loss (treadle.engine.loss_graph)
    top_k, sent = targets.top_k, targets.sent
    K = lp.shape[2] if top_k else None
    inputs: dict[str, torch.Tensor] = {}
    for key in FLOAT_KEYS if custom is None else ():
        if not any(key in d.loss_inputs for d in batch.data):
            continue
        if key == "weights":
            inputs[key] = _pad(
                [d.loss_inputs[key] for d in batch.data], n, T, K, np.float32, device
            )
            continue
        # a per-token clip threshold sent for some datums only: the others use the config's
        default = batch.loss_config.get(key, CLIP_DEFAULTS.get(key, 0.0))
        padded = np.zeros((n, T), dtype=np.float32)  # (n, T)
        for i, d in enumerate(batch.data):
            padded[i, : lengths[i]] = d.loss_inputs.get(key, default)
        inputs[key] = torch.from_numpy(padded).to(device)

    real = torch.arange(T, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    if top_k:
        real = real[..., None] & _k_mask(sent, n, T, K, device)  # (n, T, K)
    if custom is None:
        per_token = LOSSES[batch.loss_fn].fn(lp, inputs, batch.loss_config)  # (n, T[, K])
    else:
        per_token = custom.per_token(lp, batch.data, sent)  # type: ignore[attr-defined]
    loss = torch.where(real, per_token, torch.zeros_like(per_token)).sum()

    lp_np = lp.detach().cpu().numpy()
    outputs = []
    for i, t in enumerate(sent):
        out = lp_np[i, : t.shape[0], : t.shape[1]] if t.ndim == 2 else lp_np[i, : t.shape[0]]
        if top_k and t.ndim == 1:
            out = lp_np[i, : t.shape[0], 0]
        outputs.append({"logprobs": np.ascontiguousarray(out, dtype=np.float32)})
    return loss, outputs


def _k_mask(targets_np: list[np.ndarray], n: int, T: int, K: int, device) -> torch.Tensor:
    """(n, 1, K) true for the K columns each datum really has."""
    k_each = torch.tensor([t.shape[1] if t.ndim == 2 else 1 for t in targets_np], device=device)
    return (torch.arange(K, device=device)[None, :] < k_each[:, None])[:, None, :]
