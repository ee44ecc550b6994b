"""The faults counted against ops across the workers of one engine (treadle.protocol.faults).

A worker whose engine faulted (or that crashed) names the ops it was running; each is blamed
once per fault. An op blamed MAX_FAULTS times is not run again: a sample op fails with
DeviceFaultError, a training op becomes a skip carrying that error in its seq_id's place,
so that its model's later ops go on. A replay (an op that ran before, re-run to restore its
model) cannot be refused that way, since its outcome was recorded: at MAX_FAULTS its model
is `unrestorable` instead, and recovery gives that one model up rather than restarting the
worker forever; so is a model whose state load (named by its `restore_id`) crashes the
worker MAX_FAULTS times.

Replays are made anew at each restore, so their faults are kept here by request id. The
ledger has no lock of its own: its engine calls it under the engine's.
"""

from __future__ import annotations

import logging

from treadle.errors import DeviceFaultError, ErrorInfo
from treadle.protocol.faults import MAX_FAULTS, restore_id, restored_model
from treadle.protocol.ops import Op, OpKind, Outcome, Skip

log = logging.getLogger("treadle.remote")


class FaultLedger:
    def __init__(self, engine_name: str):
        self.engine_name = engine_name
        self.replay_faults: dict[str, int] = {}  # replay or restore_id → faults so far
        self.unrestorable: dict[str, str] = {}  # model → why its replays cannot run

    def replay_sent(self, op: Op) -> None:
        """A replay is sent again: it carries the faults counted against it before."""
        op.faults = self.replay_faults.get(op.request_id, op.faults)

    def replay_ran(self, request_id: str) -> None:
        self.replay_faults.pop(request_id, None)

    def state_loaded(self, model_id: str) -> None:
        """The model's state loaded well: its earlier load faults are forgotten."""
        self.replay_faults.pop(restore_id(model_id), None)

    def blame(
        self, sent: dict[str, Op], request_ids: list[str], error: str
    ) -> tuple[list[Outcome], dict[str, Op]]:
        """These ops (of `sent`, the engine's unfinished ops) were running when the engine
        failed with `error`: → the sample ops given up (their outcomes; they leave `sent`)
        and the skips that take given-up training ops' places (in `sent` already; the
        engine's outbox must take them too)."""
        given_up: list[Outcome] = []
        skips: dict[str, Op] = {}
        for rid in request_ids:
            if (model_id := restored_model(rid)) is not None:
                self._load_failed(rid, model_id, error)
                continue
            op = sent.get(rid)
            if op is None:
                continue
            op.faults += 1
            why = (
                f"was running each time the engine of {self.engine_name!r} failed, "
                f"{op.faults} times, each in a new worker process"
            )
            last = f"the last failure: {error}"
            if op.replay:
                self._replay_failed(op, why, last)
                continue
            if op.faults < MAX_FAULTS:
                continue  # it runs alone next time
            refusal = DeviceFaultError(f"this request {why}, so it is not run again; {last}")
            log.error("request %s (%s): %s", rid, op.kind, refusal)
            if op.kind == OpKind.SAMPLE:
                del sent[rid]
                given_up.append(Outcome.failed(rid, refusal))
                continue
            skip = Op(rid, OpKind.SKIP, Skip(ErrorInfo.of(refusal)), op.model_id, op.seq_id)
            skip.enqueued_at = op.enqueued_at
            sent[rid] = skips[rid] = skip
        return given_up, skips

    def _replay_failed(self, op: Op, why: str, last: str) -> None:
        """Its outcome was recorded: the model is restored with it or not at all."""
        self.replay_faults[op.request_id] = op.faults
        if op.faults >= MAX_FAULTS and op.model_id not in self.unrestorable:
            self.unrestorable[op.model_id] = (
                f"model {op.model_id!r} could not be restored after a restart: request "
                f"{op.request_id} ({op.kind}, seq_id {op.seq_id}), which ran before and is "
                f"run again to restore its state, {why}; {last}; create a training client "
                "from its last checkpoint"
            )
            log.error("%s", self.unrestorable[op.model_id])

    def _load_failed(self, rid: str, model_id: str, error: str) -> None:
        """The worker failed while loading the model's state to restore it."""
        faults = self.replay_faults[rid] = self.replay_faults.get(rid, 0) + 1
        if faults >= MAX_FAULTS and model_id not in self.unrestorable:
            self.unrestorable[model_id] = (
                f"model {model_id!r} could not be restored after a restart: the engine of "
                f"{self.engine_name!r} failed each time while loading its state to restore "
                f"it, {faults} times, each in a new worker process; the last failure: "
                f"{error}; create a training client from its last checkpoint"
            )
            log.error("%s", self.unrestorable[model_id])
