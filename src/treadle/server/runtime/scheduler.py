"""The scheduling rule: which queued ops run in the next round, grouped into engine calls.

A pure function of the queues (`plan_round`), tested alone; the engine loop
(treadle.server.runtime.engine_loop) calls it once per round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from treadle.server.runtime.ops import TRAIN_KINDS, Op, OpKind, TrainData

# Consecutive train ops of one model merged into one engine call hold at most this many tokens.
DEFAULT_MAX_MERGE_TOKENS = 65536


@dataclass
class ModelQueue:
    """Ops of one training model waiting for their turn; `next_seq` is the one due next."""

    next_seq: int = 0
    pending: dict[int, Op] = field(default_factory=dict)


@dataclass
class Step:
    """One engine call: a mixed-session train batch (each model's ops consecutive, in seq_id
    order), one single op, or a sample batch."""

    kind: Literal["train", "single", "sample"]
    ops: list[Op]
    forward_only: bool = False


def plan_round(
    queues: dict[str, ModelQueue],
    samples: list[Op],
    max_sample_batch: int,
    max_merge_tokens: int = DEFAULT_MAX_MERGE_TOKENS,
) -> list[Step]:
    """The scheduling rule: which ops run in this round, grouped into engine calls.

    Invariant: the ops of one model run strictly in seq_id order. A model contributes only
    from its head, the op whose seq_id equals its `next_seq`; a model whose next op has not
    arrived yet (a gap) contributes nothing and waits. Any op that is not
    forward/forward_backward (optim_step, saves, loads, create) is a barrier for its own
    model only: it runs alone as a "single" step while other models keep going.
    A forward/forward_backward head takes along the consecutive ops after it that could
    have run right after it unchanged (same kind, loss_fn and loss_fn_config; no gap, no
    barrier; up to max_merge_tokens in all): the chunks the SDKs split a big batch into run
    as one engine call, and since the weights cannot change between them, each gets exactly
    what it would have got alone (gradients add up the same, up to float rounding).
    Forward_backward runs of all models share ONE engine call, as do forward runs (the
    engine takes forward_only per call); all pending samples (up to max_sample_batch, oldest
    first) share one engine.sample call. Within a round: singles, then train, then sample.
    """
    singles: list[Step] = []
    train: dict[bool, list[list[Op]]] = {False: [], True: []}
    for queue in queues.values():
        head = queue.pending.get(queue.next_seq)
        if head is None:
            continue
        if head.kind in TRAIN_KINDS:
            train[head.kind == OpKind.FORWARD].append(_train_run(queue, head, max_merge_tokens))
        else:
            singles.append(Step("single", [head]))
    steps = singles
    for forward_only in (False, True):
        if train[forward_only]:
            runs = sorted(train[forward_only], key=lambda run: run[0].enqueued_at)
            steps.append(Step("train", [op for run in runs for op in run], forward_only))
    if samples:
        steps.append(
            Step("sample", sorted(samples, key=lambda op: op.enqueued_at)[:max_sample_batch])
        )
    return steps


def _train_run(queue: ModelQueue, head: Op, max_tokens: int) -> list[Op]:
    """The head and the consecutive ops of its model that may share its engine call."""
    run, tokens = [head], _tokens(head)
    while (nxt := queue.pending.get(run[-1].seq_id + 1)) is not None and _same_call(head, nxt):
        tokens += _tokens(nxt)
        if tokens > max_tokens:
            break
        run.append(nxt)
    return run


def _same_call(head: Op, op: Op) -> bool:
    if op.kind != head.kind:
        return False
    a, b = head.payload, op.payload
    assert isinstance(a, TrainData) and isinstance(b, TrainData)
    return a.loss_fn == b.loss_fn and a.loss_config == b.loss_config


def _tokens(op: Op) -> int:
    return op.payload.n_tokens if isinstance(op.payload, TrainData) else 0
