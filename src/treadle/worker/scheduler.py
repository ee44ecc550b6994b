"""The scheduling rule: which queued ops run in the next round, grouped into engine calls,
when decoding gives way to them, and the rules for ops parked behind a gap in their
model's seq_ids.

Functions of the queues (`plan_round`, `yield_decode`, `enqueue`, `expire_parked`), tested
alone; the engine loop (treadle.worker.loop) calls them under its lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from treadle.errors import ErrorInfo, InvalidRequestError
from treadle.protocol.ops import TRAIN_KINDS, Op, OpKind, Outcome, Skip, TrainData

# Consecutive train ops of one model merged into one engine call hold at most this many tokens.
DEFAULT_MAX_MERGE_TOKENS = 65536


@dataclass
class ModelQueue:
    """Ops of one training model waiting for their turn; `next_seq` is the one due next."""

    next_seq: int = 0
    pending: dict[int, Op] = field(default_factory=dict)
    # Of the ops parked behind a gap: their sizes, and which are stand-ins of refused ones.
    parked_bytes: dict[int, int] = field(default_factory=dict)
    stand_ins: set[int] = field(default_factory=set)

    def first_gap(self) -> int:
        """The first seq_id, from next_seq on, that has not arrived."""
        seq = self.next_seq
        while seq in self.pending:
            seq += 1
        return seq


@dataclass(frozen=True)
class ParkLimits:
    """Per model: how many ops may wait behind a gap, holding how many bytes, for how long
    (ServerConfig max_parked_ops, max_parked_bytes, parked_op_timeout_s)."""

    max_ops: int = 1024
    max_bytes: int = 1 << 30
    timeout_s: float = 600.0


DEFAULT_PARK_LIMITS = ParkLimits()  # the ServerConfig defaults


def op_bytes(op: Op) -> int:
    """The memory an op holds: the arrays of its train data (other payloads are small)."""
    if not isinstance(op.payload, TrainData):
        return 0
    return sum(
        d.tokens.nbytes + sum(getattr(a, "nbytes", 0) for a in d.loss_inputs.values())
        for d in op.payload.data
    )


def enqueue(queue: ModelQueue, op: Op, limits: ParkLimits) -> InvalidRequestError | None:
    """Queue a model's op in its seq_id's place, or say why not.

    An op at or before the first gap in the model's seq_ids waits its turn. One behind the
    gap is parked, and a model's parked ops hold at most `limits.max_ops` ops and
    `limits.max_bytes` bytes: one more is refused, and a stand-in holds its place (its
    failure, which runs in its turn, so that the ops after it do not wait for it), as for
    any request refused at the edge; stand-ins are bounded by max_ops too, and a refused op
    with no room left for one leaves a gap, closed at the deadline (expire_parked). An op
    whose seq_id the model has moved past (expire_parked closed it) is refused.
    """
    if op.seq_id in queue.pending:
        return InvalidRequestError(
            f"seq_id: {op.seq_id} of model {op.model_id!r} is already queued; a request is "
            "sent again with the seq_id it was first sent with, and answered once"
        )
    if op.seq_id < queue.next_seq:
        return InvalidRequestError(
            f"seq_id: {op.seq_id} of model {op.model_id!r} is behind the model, which "
            f"continues from seq_id {queue.next_seq} (it ran already, or it was given up "
            "after the requests behind it waited past parked_op_timeout_s)"
        )
    gap = queue.first_gap()
    if op.seq_id <= gap:
        queue.pending[op.seq_id] = op
        return None
    parked = {seq: o for seq, o in queue.pending.items() if seq > gap}
    queue.stand_ins &= parked.keys()
    held_bytes = {s: queue.parked_bytes.get(s) or op_bytes(o) for s, o in parked.items()}
    queue.parked_bytes = held_bytes
    ops, held, size = len(parked) - len(queue.stand_ins), sum(held_bytes.values()), op_bytes(op)
    if ops + 1 > limits.max_ops:
        over = f"max_parked_ops {limits.max_ops} (already {ops} waiting)"
    elif held + size > limits.max_bytes:
        over = f"max_parked_bytes {limits.max_bytes} (already {held} bytes, this one {size})"
    else:
        queue.pending[op.seq_id], held_bytes[op.seq_id] = op, size
        return None
    error = InvalidRequestError(
        f"seq_id {op.seq_id} of model {op.model_id!r} is refused: it would wait for seq_id "
        f"{gap}, which has not arrived, and the requests waiting for it reach the server's "
        f"bound {over}; send seq_id {gap} first"
    )
    if len(queue.stand_ins) < limits.max_ops:
        skip = Skip(ErrorInfo.of(error))
        queue.pending[op.seq_id] = Op(op.request_id, OpKind.SKIP, skip, op.model_id, op.seq_id)
        queue.stand_ins.add(op.seq_id)
    return error


def parked_deadline(queue: ModelQueue, timeout_s: float) -> float | None:
    """When the oldest op of a stalled model (its next seq_id missing) times out, or None."""
    if not queue.pending or queue.next_seq in queue.pending:
        return None
    return min(op.enqueued_at for op in queue.pending.values()) + timeout_s


def expire_parked(model_id: str, queue: ModelQueue, now: float, timeout_s: float) -> list[Outcome]:
    """Give up a stalled model's missing seq_id once the first op waiting for it has waited
    `timeout_s`: every op waiting behind it fails, naming it, and the model moves past them.

    Only a stalled model (its next seq_id missing) is touched, so ops that can run are never
    failed. All its queued ops wait for the same missing seq_id, so they fail together, and
    the model's next seq_id becomes the highest of them + 1: the seq_ids left out are closed
    (a late one is refused), and the requests a user sends from then on run, as a user
    whose loop has moved on expects. Stand-ins go without a word: their requests have
    failed already.
    """
    deadline = parked_deadline(queue, timeout_s)
    if deadline is None or deadline > now:
        return []
    gap, last = queue.next_seq, max(queue.pending)
    failed = []
    for seq in sorted(queue.pending):
        op = queue.pending.pop(seq)
        if seq in queue.stand_ins:
            continue
        error = InvalidRequestError(
            f"seq_id {gap} of model {model_id!r} did not arrive within parked_op_timeout_s "
            f"({timeout_s:g} s); the requests that waited for it (seq_id {seq} among them) "
            f"are cancelled, and the model continues from seq_id {last + 1}"
        )
        failed.append(Outcome.failed(op.request_id, error))
    queue.parked_bytes.clear()
    queue.stand_ins.clear()
    queue.next_seq = last + 1
    return failed


@dataclass
class Step:
    """One engine call: a mixed-session train batch (each model's ops consecutive, in seq_id
    order), one single op, or sample ops joining the decode batch."""

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
    engine takes forward_only per call); pending samples (up to max_sample_batch, the room
    the decode batch has left, oldest first) join the decode batch in one prefill. Within a
    round: singles, then train, then sample; then the loop decodes until `yield_decode`.
    An op that was running at an engine fault (`op.faults`, treadle.protocol.faults)
    is a call of its own: its train run holds only it, and a sample op of that kind is a
    step of its own, which the executor runs outside the shared decode batch.
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
        runs = sorted(train[forward_only], key=lambda run: run[0].enqueued_at)
        shared = [op for run in runs if not run[0].faults for op in run]
        if shared:
            steps.append(Step("train", shared, forward_only))
        steps += [Step("train", run, forward_only) for run in runs if run[0].faults]
    if samples and max_sample_batch > 0:
        taken = sorted(samples, key=lambda op: op.enqueued_at)[:max_sample_batch]
        if shared := [op for op in taken if not op.faults]:
            steps.append(Step("sample", shared))
        steps += [Step("sample", [op]) for op in taken if op.faults]
    return steps


def runnable_samples(
    queues: dict[str, ModelQueue], samples: list[Op], is_live: Callable[[str], bool]
) -> list[Op]:
    """The recovery rule: which waiting sample ops may run now.

    After a restart, recovery queues each model's replays, then its unfinished samples. A
    sample of a sampler that a replay has yet to make again (a
    save_weights_and_get_sampling_client acknowledged after the model's last state
    snapshot) waits while replays are queued; then it runs, or fails if its weights never
    came back. Without queued replays every sample may run.
    """
    if not samples or not any(op.replay for q in queues.values() for op in q.pending.values()):
        return samples
    return [
        op
        for op in samples
        if (ref := op.payload.request.adapter) is None or ref in queues or is_live(ref)
    ]


def yield_decode(queues: dict[str, ModelQueue], samples: list[Op], room: int) -> bool:
    """The decode rule: whether the decode batch must stop after this decode step.

    Invariant: no op that can run waits behind decoding for more than one decode step. The
    batch gives way as soon as some model's head has arrived (its next seq_id: a train or a
    single op), or a sample op waits while the batch has room for it (it joins in the next
    round: continuous batching). Ops parked behind a gap do not interrupt decoding, and a
    round always decodes at least one step, so a stream of training ops slows a generation
    down but never stops it.
    """
    if samples and room > 0:
        return True
    return any(q.next_seq in q.pending for q in queues.values())


def _train_run(queue: ModelQueue, head: Op, max_tokens: int) -> list[Op]:
    """The head and the consecutive ops of its model that may share its engine call."""
    run, tokens = [head], _tokens(head)
    if head.faults:
        return run
    while (nxt := queue.pending.get(run[-1].seq_id + 1)) is not None and _same_call(head, nxt):
        tokens += _tokens(nxt)
        if tokens > max_tokens:
            break
        run.append(nxt)
    return run


def _same_call(head: Op, op: Op) -> bool:
    if op.kind != head.kind or op.faults:
        return False
    a, b = head.payload, op.payload
    assert isinstance(a, TrainData) and isinstance(b, TrainData)
    return a.loss_fn == b.loss_fn and a.loss_config == b.loss_config


def _tokens(op: Op) -> int:
    return op.payload.n_tokens if isinstance(op.payload, TrainData) else 0
