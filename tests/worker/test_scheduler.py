"""The scheduling rule (plan_round) alone, then the engine loop with a fake engine.

A fake engine belongs here: these tests are about which calls the loop makes and in what
order, not about numbers (the API tests run the real engine).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from treadle.engine.types import AdamSpec, LoraSpec, SampleRequest, TrainDatum, TrainResult
from treadle.errors import EngineDeadError, ErrorInfo, InvalidRequestError
from treadle.protocol.facts import EngineFacts
from treadle.protocol.faults import EngineFault, restore_id
from treadle.protocol.ops import (
    CreateAdapter,
    Op,
    OpKind,
    OptimStep,
    Outcome,
    Sample,
    Skip,
    TrainData,
)
from treadle.worker import loop as engine_loop
from treadle.worker.executor import OpExecutor
from treadle.worker.loop import EngineLoop
from treadle.worker.scheduler import ModelQueue, plan_round

FACTS = EngineFacts("fake", vocab_size=10, max_seq_len=16, max_lora_rank=8)


def payload_of(kind: OpKind, n_tokens: int = 2, loss: str = "cross_entropy"):
    if kind in (OpKind.FORWARD, OpKind.FORWARD_BACKWARD):
        tokens = np.arange(n_tokens)
        inputs = {"target_tokens": tokens, "weights": np.ones(n_tokens, np.float32)}
        return TrainData([TrainDatum(tokens, inputs)], loss, {})
    if kind == OpKind.OPTIM_STEP:
        return OptimStep(AdamSpec())
    if kind == OpKind.SAMPLE:
        return Sample(SampleRequest([1, 2]))
    if kind == OpKind.CREATE:
        return CreateAdapter(LoraSpec())
    return Skip(ErrorInfo("InvalidRequestError", "refused at the edge", "user"))


def op(kind: str, model: str | None, seq: int | None, t: float = 0.0) -> Op:
    k = OpKind(kind)
    return Op(f"{model}-{seq}-{kind}", k, payload_of(k), model, seq, enqueued_at=t)


def queue(next_seq: int, *ops: Op) -> ModelQueue:
    return ModelQueue(next_seq=next_seq, pending={o.seq_id: o for o in ops})


def test_a_gap_blocks_its_model_only():
    queues = {
        "a": queue(1, op("forward_backward", "a", 2), op("optim_step", "a", 3)),
        "b": queue(4, op("forward_backward", "b", 4)),
    }
    steps = plan_round(queues, [], 8)
    assert [(s.kind, [o.request_id for o in s.ops]) for s in steps] == [
        ("train", ["b-4-forward_backward"])
    ]


def chunk(kind: str, model: str, seq: int, loss: str = "cross_entropy", n_tokens: int = 2) -> Op:
    k = OpKind(kind)
    return Op(f"{model}-{seq}-{kind}", k, payload_of(k, n_tokens, loss), model, seq)


def test_consecutive_chunks_of_one_model_share_its_engine_call_in_seq_order():
    fb = "forward_backward"
    queues = {
        "a": queue(1, *(chunk(fb, "a", s) for s in (3, 1, 2)), op("optim_step", "a", 4)),
        "b": queue(0, chunk(fb, "b", 0), chunk(fb, "b", 2)),  # seq 1 missing: a gap
        "c": queue(0, chunk(fb, "c", 0), chunk(fb, "c", 1, loss="ppo")),
        "d": queue(0, chunk(fb, "d", 0), chunk("forward", "d", 1)),
    }
    steps = plan_round(queues, [], 8)
    assert len(steps) == 1 and steps[0].kind == "train" and not steps[0].forward_only
    by_model: dict[str, list[int]] = {}
    for o in steps[0].ops:
        by_model.setdefault(o.model_id, []).append(o.seq_id)
    # a: up to its optim_step barrier; b: up to its gap; c: not across a loss change;
    # d: a forward never joins a forward_backward call
    assert by_model == {"a": [1, 2, 3], "b": [0], "c": [0], "d": [0]}
    # each model's ops stay together, so a one-by-one retry keeps their order
    models = [o.model_id for o in steps[0].ops]
    assert models == sorted(models, key=models.index)


def test_merging_stops_at_the_token_cap_but_the_head_always_runs():
    fb = "forward_backward"
    queues = {"a": queue(0, *(chunk(fb, "a", s, n_tokens=40) for s in range(4)))}
    assert [o.seq_id for o in plan_round(queues, [], 8, max_merge_tokens=100)[0].ops] == [0, 1]
    assert [o.seq_id for o in plan_round(queues, [], 8, max_merge_tokens=10)[0].ops] == [0]


def test_a_payload_must_match_its_kind():
    with pytest.raises(TypeError, match="payload must be TrainData"):
        Op("x", OpKind.FORWARD_BACKWARD, OptimStep(AdamSpec()), "a", 0)


def test_train_heads_of_all_models_share_one_call_and_optim_is_a_per_model_barrier():
    queues = {
        "a": queue(3, op("forward_backward", "a", 3, t=2.0)),
        "b": queue(5, op("optim_step", "b", 5), op("forward_backward", "b", 6)),
        "c": queue(1, op("forward_backward", "c", 1, t=1.0)),
        "d": queue(2, op("forward", "d", 2)),
    }
    steps = plan_round(queues, [], 8)
    assert [s.kind for s in steps] == ["single", "train", "train"]
    assert steps[0].ops[0].request_id == "b-5-optim_step"
    assert [o.model_id for o in steps[1].ops] == ["c", "a"]  # oldest first
    assert steps[1].forward_only is False
    assert [o.model_id for o in steps[2].ops] == ["d"] and steps[2].forward_only is True


def test_samples_share_one_call_up_to_the_cap_oldest_first():
    samples = [op("sample", None, i, t=float(10 - i)) for i in range(5)]
    steps = plan_round({}, samples, 3)
    assert len(steps) == 1 and steps[0].kind == "sample"
    assert [o.seq_id for o in steps[0].ops] == [4, 3, 2]


def test_an_op_that_was_running_at_an_engine_fault_is_a_call_of_its_own():
    suspect = op("forward_backward", "a", 2, t=1.0)
    suspect.faults = 1
    queues = {
        "a": queue(2, suspect, op("forward_backward", "a", 3)),  # its next chunk waits
        "b": queue(0, op("forward_backward", "b", 0, t=2.0)),
        "c": queue(4, op("forward_backward", "c", 4, t=3.0), op("forward_backward", "c", 5)),
    }
    queues["c"].pending[5].faults = 1  # a suspect follower is not taken along either
    samples = [op("sample", None, i, t=float(i)) for i in range(3)]
    samples[1].faults = 1
    steps = plan_round(queues, samples, 8)
    assert [(s.kind, [o.request_id for o in s.ops]) for s in steps] == [
        ("train", ["b-0-forward_backward", "c-4-forward_backward"]),
        ("train", ["a-2-forward_backward"]),
        ("sample", ["None-0-sample", "None-2-sample"]),
        ("sample", ["None-1-sample"]),
    ]


# ---- the loop, with a fake engine ----------------------------------------------------------


class FakeEngine:
    """Records forward_backward calls; a batch of adapter 'bad' is refused as the real
    engine refuses bad input: before computing anything."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.lock = threading.Lock()

    def forward_backward(self, batches, forward_only=False):
        with self.lock:
            self.calls.append([b.adapter_id for b in batches])
        if any(b.adapter_id == "bad" for b in batches):
            raise InvalidRequestError("data[0].loss_fn_inputs['weights']: bad (fake)")
        return [
            TrainResult(
                outputs=[{"logprobs": np.zeros(len(d.tokens), np.float32)} for d in b.data],
                metrics={"loss:sum": float(len(b.data))},
            )
            for b in batches
        ]

    def create_adapter(self, adapter_id, spec):
        with self.lock:
            self.calls.append([f"create:{adapter_id}"])

    def optim_step(self, adapter_id, spec):
        with self.lock:
            self.calls.append([f"optim:{adapter_id}"])
        if adapter_id == "boom":
            raise RuntimeError("the device fell over (fake)")
        return {}


class FaultyDeviceEngine(FakeEngine):
    """A batch of adapter 'poison' raises CUDA's illegal-address error (as torch does)."""

    def forward_backward(self, batches, forward_only=False):
        if any(b.adapter_id == "poison" for b in batches):
            with self.lock:
                self.calls.append([b.adapter_id for b in batches])
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return super().forward_backward(batches, forward_only)


def train_op(model: str, seq: int, loss_fn: str = "cross_entropy") -> Op:
    kind = OpKind.FORWARD_BACKWARD
    return Op(f"{model}:{seq}", kind, payload_of(kind, 2, loss_fn), model, seq)


class Collector:
    def __init__(self, expect: int):
        self.outcomes: dict[str, Outcome] = {}
        self.order: list[str] = []
        self.expect = expect
        self.done = threading.Event()

    def __call__(self, outcomes: list[Outcome]):
        for o in outcomes:
            self.outcomes[o.request_id] = o
            self.order.append(o.request_id)
        if len(self.outcomes) >= self.expect:
            self.done.set()


def make_worker(engine: FakeEngine, expect: int) -> tuple[EngineLoop, Collector]:
    collect = Collector(expect)
    return EngineLoop(FACTS, OpExecutor(engine, writer=None), collect), collect


def test_worker_waits_for_the_gap_then_runs_in_seq_order():
    engine = FakeEngine()
    worker, collect = make_worker(engine, expect=4)
    worker.add_model("a")
    worker.start()
    try:
        worker.submit(Op("a:3", OpKind.OPTIM_STEP, OptimStep(AdamSpec()), "a", 3))
        worker.submit(train_op("a", 2))
        worker.submit(train_op("a", 1, loss_fn="ppo"))
        assert not collect.done.wait(0.3)  # seq 0 missing: nothing may run
        assert engine.calls == []
        worker.submit(train_op("a", 0))
        assert collect.done.wait(10)
    finally:
        worker.stop()
    assert collect.order == ["a:0", "a:1", "a:2", "a:3"]
    assert engine.calls == [["a"], ["a"], ["a"], ["optim:a"]]  # a loss change: no merging


def test_the_worker_owns_its_models_order_and_refuses_a_seq_id_used_before():
    """The API files every seq_id once (its dedup key is unique); the worker keeps the order:
    a seq_id the model has run, or one already queued, fails as its own future; a model's
    queue opens with its create op, and an op of a model it never made fails too."""
    engine = FakeEngine()
    worker, collect = make_worker(engine, expect=5)
    worker.start()
    try:
        worker.submit(Op("a:0", OpKind.CREATE, payload_of(OpKind.CREATE), "a", 0))
        worker.submit(train_op("a", 2))  # waits for 1
        worker.submit(Op("again:2", OpKind.OPTIM_STEP, OptimStep(AdamSpec()), "a", 2))
        worker.submit(train_op("a", 1))
        deadline = time.monotonic() + 10
        while "a:2" not in collect.outcomes and time.monotonic() < deadline:
            time.sleep(0.01)
        worker.submit(Op("late:1", OpKind.OPTIM_STEP, OptimStep(AdamSpec()), "a", 1))
        worker.submit(train_op("never", 1))
        assert collect.done.wait(10)
    finally:
        worker.stop()
    assert all(collect.outcomes[r].succeeded for r in ("a:0", "a:1", "a:2"))
    assert "already queued" in collect.outcomes["again:2"].error.message
    late = collect.outcomes["late:1"].error
    assert late.type == "InvalidRequestError" and "continues from seq_id 3" in late.message
    assert "unloaded" in collect.outcomes["never:1"].error.message


def test_worker_runs_the_chunks_of_a_batch_as_one_engine_call():
    engine = FakeEngine()
    worker, collect = make_worker(engine, expect=4)
    worker.add_model("a")
    worker.start()
    try:
        # as the SDKs send a chunked batch: the first chunk last
        for seq in (2, 3, 1):
            worker.submit(train_op("a", seq))
        assert not collect.done.wait(0.3)
        worker.submit(train_op("a", 0))
        assert collect.done.wait(10)
    finally:
        worker.stop()
    assert engine.calls == [["a", "a", "a", "a"]]
    assert collect.order == ["a:0", "a:1", "a:2", "a:3"]
    assert all(collect.outcomes[f"a:{s}"].succeeded for s in range(4))


def test_worker_batches_sessions_and_isolates_a_bad_request():
    engine = FakeEngine()
    worker, collect = make_worker(engine, expect=3)
    for model in ("a", "b", "bad"):
        worker.add_model(model)
        worker.submit(train_op(model, 0))
    worker.start()  # all three are queued before the first round: one engine call
    try:
        assert collect.done.wait(10)
    finally:
        worker.stop()
    assert sorted(engine.calls[0]) == ["a", "b", "bad"]
    assert sorted(map(tuple, engine.calls[1:])) == [("a",), ("b",), ("bad",)]  # retried alone
    assert collect.outcomes["a:0"].succeeded and collect.outcomes["b:0"].succeeded
    bad = collect.outcomes["bad:0"].error
    assert bad.type == "InvalidRequestError" and bad.category == "user"
    assert "weights" in bad.message


def test_worker_keeps_running_after_an_unexpected_error():
    engine = FakeEngine()
    worker, collect = make_worker(engine, expect=4)
    for model in ("a", "boom"):
        worker.add_model(model)
    worker.submit(train_op("gone", 0))  # a model never added (its session ended)
    worker.submit(Op("boom:0", OpKind.OPTIM_STEP, OptimStep(AdamSpec()), "boom", 0))
    worker.submit(Op("a:0", OpKind.SKIP, payload_of(OpKind.SKIP), "a", 0))
    worker.submit(train_op("a", 1))
    worker.start()
    try:
        assert collect.done.wait(10)
    finally:
        worker.stop()
    boom = collect.outcomes["boom:0"].error
    assert boom.category == "server" and "fell over" in boom.message
    skipped = collect.outcomes["a:0"].error  # holds seq 0's place with the edge's error
    assert skipped.type == "InvalidRequestError" and "refused" in skipped.message
    assert collect.outcomes["a:1"].succeeded
    assert "unloaded" in collect.outcomes["gone:0"].error.message


def test_a_dead_loop_fails_every_pending_future_and_every_later_one(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("scheduler bug (fake)")

    monkeypatch.setattr(engine_loop, "plan_round", broken)
    engine = FakeEngine()
    worker, collect = make_worker(engine, expect=3)
    worker.add_model("a")
    worker.submit(train_op("a", 0))
    worker.submit(op("sample", None, None))
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while len(collect.outcomes) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        worker.submit(train_op("a", 1))  # after the loop died: failed at once, never queued
        assert collect.done.wait(10)
    finally:
        worker.stop()
    assert {o.error.type for o in collect.outcomes.values()} == {"EngineDeadError"}
    assert all("fake" in o.error.message for o in collect.outcomes.values())


def test_an_engine_fault_goes_to_on_fault_with_the_ops_of_the_call_before_any_outcome():
    """A worker exits in on_fault (the API runs the ops again), so nothing is failed.
    Run again with op.faults set, each op is an engine call of its own."""
    engine = FaultyDeviceEngine()
    faults: list[tuple[EngineFault, int]] = []
    collect = Collector(expect=2)

    def on_fault(fault: EngineFault) -> None:
        faults.append((fault, len(collect.outcomes)))

    worker = EngineLoop(FACTS, OpExecutor(engine, writer=None), collect, on_fault=on_fault)
    for model in ("a", "poison"):
        worker.add_model(model)
        worker.submit(train_op(model, 0))
    worker.start()  # both are queued before the first round: one engine call
    try:
        deadline = time.monotonic() + 10
        while not faults and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        worker.stop()
    assert engine.calls == [["a", "poison"]]  # no retry one by one on a broken device
    fault, heard_before = faults[0]
    assert sorted(o.request_id for o in fault.ops) == ["a:0", "poison:0"]
    assert "illegal memory access" in str(fault) and heard_before == 0

    engine = FaultyDeviceEngine()
    worker, collect = make_worker(engine, expect=2)
    for model in ("a", "poison"):
        worker.add_model(model)
        again = train_op(model, 0)
        again.faults = 1
        worker.submit(again)
    worker.start()
    try:
        assert collect.done.wait(10)
    finally:
        worker.stop()
    assert engine.calls == [["a"], ["poison"]]
    assert collect.outcomes["a:0"].succeeded  # the poison's second fault: its loop dies alone
    assert collect.outcomes["poison:0"].error.type == "EngineDeadError"


def test_a_control_call_that_breaks_the_device_is_an_engine_fault_too():
    faults: list[EngineFault] = []
    executor = OpExecutor(FakeEngine(), writer=None)
    worker = EngineLoop(FACTS, executor, Collector(0), on_fault=faults.append)

    def unknown_ref():
        raise InvalidRequestError("ref: no such sampler")

    def restore():
        raise torch.AcceleratorError("CUDA error: device-side assert triggered")

    worker.start()
    try:
        with pytest.raises(InvalidRequestError):
            worker.call(unknown_ref).result(timeout=10)  # a request's own error: no fault
        assert not faults
        # the caller hears that the engine stopped; the fault names what the call ran
        with pytest.raises(EngineDeadError, match="device-side assert"):
            worker.call(restore, [restore_id("m1")]).result(timeout=10)
        deadline = time.monotonic() + 10
        while not faults and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        worker.stop()
    assert len(faults) == 1 and not faults[0].ops
    assert faults[0].running_ids == [restore_id("m1")]
    assert "device-side assert" in str(faults[0])
