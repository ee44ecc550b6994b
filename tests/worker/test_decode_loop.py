"""The engine loop with a real engine (the tiny model): sampling interleaved with training.

A generation no longer holds the engine thread: other sessions' ops run between its decode
steps, new sample requests join it, streamed tokens come out step by step, and the weights a
request started with stay its weights. Assertions are about order (which outcome, which
decode step), never about wall-clock bounds.

    .venv/bin/python -m pytest -q tests/worker/test_decode_loop.py
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from treadle.engine.types import (
    AdamSpec,
    LoraSpec,
    SampleRequest,
    SampleSpec,
    TrainDatum,
)
from treadle.protocol.facts import EngineFacts, SnapshotPolicy
from treadle.protocol.ops import (
    CreateAdapter,
    Op,
    OpKind,
    OptimStep,
    Outcome,
    Progress,
    Sample,
    Snapshot,
    TrainData,
)
from treadle.worker.executor import OpExecutor
from treadle.worker.loop import EngineLoop
from treadle.worker.scheduler import ModelQueue, yield_decode

torch.set_num_threads(1)
WAIT = 120


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from treadle.engine import Engine

    return Engine(tiny_model_dir)


class Log:
    """Outcomes and progress as the loop reports them, with the decode step each came at."""

    def __init__(self, engine):
        self.outcomes: dict[str, Outcome] = {}
        self.at_step: dict[str, int] = {}
        self.progress: list[Progress] = []
        self.decode_steps = 0  # model calls of one token per row
        self.cond = threading.Condition()
        self._hook = engine.model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            self.decode_steps += 1

    def outcome(self, outcomes: list[Outcome]) -> None:
        with self.cond:
            for o in outcomes:
                self.outcomes[o.request_id] = o
                self.at_step[o.request_id] = self.decode_steps
            self.cond.notify_all()

    def on_progress(self, items: list[Progress]) -> None:
        with self.cond:
            self.progress += items
            self.cond.notify_all()

    def wait(self, pred) -> None:
        with self.cond:
            assert self.cond.wait_for(pred, WAIT)

    def close(self) -> None:
        self._hook.remove()


@pytest.fixture
def make_loop(engine):
    """make_loop(**EngineLoop settings) → a started loop on the tiny engine, stopped after."""
    loops = []

    def make(**settings) -> EngineLoop:
        log = Log(engine)
        executor = OpExecutor(engine, writer=None)
        worker = EngineLoop(
            EngineFacts.of("tiny", engine),
            executor,
            log.outcome,
            on_progress=log.on_progress,
            **settings,
        )
        worker.log = log
        worker.start()
        loops.append(worker)
        return worker

    yield make
    for worker in loops:
        worker.stop()
        worker.log.close()
    for ref in [k for k in engine.bank.adapters if k.startswith("m-")]:
        engine.drop_adapter(ref)


@pytest.fixture
def loop(make_loop):
    return make_loop()


def sample_op(rid: str, max_tokens: int, seed: int, adapter=None, stream=False, n=1) -> Op:
    spec = SampleSpec(max_tokens=max_tokens, seed=seed, stop_at_eos=False)
    req = SampleRequest([5, 6, 7, 8], num_samples=n, params=spec, adapter=adapter)
    return Op(rid, OpKind.SAMPLE, Sample(req, stream=stream))


def train_op(model: str, seq: int, kind=OpKind.FORWARD_BACKWARD) -> Op:
    if kind == OpKind.OPTIM_STEP:
        return Op(f"{model}:{seq}", kind, OptimStep(AdamSpec(learning_rate=0.05)), model, seq)
    tokens = np.arange(1, 9)
    inputs = {"target_tokens": np.arange(2, 10), "weights": np.ones(8, np.float32)}
    payload = TrainData([TrainDatum(tokens, inputs)], "cross_entropy", {})
    return Op(f"{model}:{seq}", kind, payload, model, seq)


def create(loop, model: str) -> None:
    loop.add_model(model)
    loop.submit(Op(f"{model}:0", OpKind.CREATE, CreateAdapter(LoraSpec(rank=4)), model, 0))
    loop.log.wait(lambda: f"{model}:0" in loop.log.outcomes)


def streamed_tokens(log: Log, rid: str) -> int:
    return sum(len(p.tokens) for p in log.progress if p.request_id == rid)


def test_a_forward_backward_waits_for_a_decode_step_not_for_a_generation(loop):
    log = loop.log
    create(loop, "m-b")
    # session A generates 32 x 256 tokens; session B's small forward_backward comes in
    # once the generation is under way
    loop.submit(sample_op("gen", max_tokens=256, seed=1, n=32, stream=True))
    log.wait(lambda: streamed_tokens(log, "gen") >= 32 * 3)
    started = log.decode_steps
    loop.submit(train_op("m-b", 1))
    log.wait(lambda: "gen" in log.outcomes)
    assert log.outcomes["m-b:1"].succeeded and log.outcomes["gen"].succeeded
    # it ran before the generation's last decode step, within a few steps of its arrival
    assert log.at_step["m-b:1"] < log.at_step["gen"]
    assert log.at_step["m-b:1"] - started <= 3, (started, log.at_step["m-b:1"])
    assert log.outcomes["m-b:1"].finished_at < log.outcomes["gen"].finished_at
    assert [len(s.tokens) for s in log.outcomes["gen"].result.sequences] == [256] * 32


def test_a_sample_request_joins_a_running_generation(loop, engine):
    log = loop.log
    loop.submit(sample_op("long", max_tokens=200, seed=2, stream=True))
    log.wait(lambda: streamed_tokens(log, "long") >= 2)
    loop.submit(sample_op("short", max_tokens=8, seed=3))
    log.wait(lambda: "long" in log.outcomes)
    assert log.at_step["short"] < log.at_step["long"]  # it did not wait for the long one
    # the same tokens as alone (a join changes nothing of a row's numbers)
    for rid, alone in (("long", sample_op("x", 200, 2)), ("short", sample_op("y", 8, 3))):
        want = engine.sample([alone.payload.request])[0].sequences[0]
        got = log.outcomes[rid].result.sequences[0]
        assert got.tokens == want.tokens
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_streamed_progress_is_the_result_token_by_token(loop):
    log = loop.log
    loop.submit(sample_op("s", max_tokens=24, seed=4, n=3, stream=True))
    loop.submit(sample_op("quiet", max_tokens=24, seed=5))
    log.wait(lambda: {"s", "quiet"} <= log.outcomes.keys())
    seqs = log.outcomes["s"].result.sequences
    rows: dict[int, list] = {}
    for p in log.progress:
        assert p.request_id == "s"  # only the op that asked for it
        for j, pos, tok, lp in p.tokens:
            rows.setdefault(j, []).append((pos, tok, lp))
    for j, seq in enumerate(seqs):
        assert [pos for pos, _, _ in rows[j]] == list(range(24))
        assert [tok for _, tok, _ in rows[j]] == seq.tokens
        assert [lp for _, _, lp in rows[j]] == pytest.approx(seq.logprobs, abs=1e-6)


def test_a_sample_keeps_the_weights_it_started_with(loop, engine):
    """An optim_step of the same session lands mid-generation: the generation keeps the
    weights it joined with (a copy), the next request sees the new ones."""
    log = loop.log
    create(loop, "m-a")
    loop.submit(train_op("m-a", 1))
    loop.submit(train_op("m-a", 2, OpKind.OPTIM_STEP))
    log.wait(lambda: "m-a:2" in log.outcomes)
    engine.snapshot("m-a", "before")
    loop.submit(sample_op("during", max_tokens=64, seed=6, adapter="m-a", stream=True))
    log.wait(lambda: streamed_tokens(log, "during") >= 2)
    loop.submit(train_op("m-a", 3))
    loop.submit(train_op("m-a", 4, OpKind.OPTIM_STEP))
    log.wait(lambda: {"during", "m-a:4"} <= log.outcomes.keys())
    assert log.at_step["m-a:4"] < log.at_step["during"]  # the step ran mid-generation
    before = engine.sample([sample_op("x", 64, 6, adapter="before").payload.request])[0]
    after = engine.sample([sample_op("y", 64, 6, adapter="m-a").payload.request])[0]
    during = log.outcomes["during"].result
    assert during.sequences[0].tokens == before.sequences[0].tokens
    assert during.sequences[0].tokens != after.sequences[0].tokens
    engine.drop_snapshot("before")
    assert not [k for k in engine.bank.snapshots if k.startswith("pin:")]  # the copy is freed


def test_a_finished_row_keeps_its_weights_until_the_batch_drops_it(loop, engine):
    """Eight chats on eight live sessions share the decode batch; one ends after 2 tokens.
    Its pin (the copy of its session's weights) is freed only once no row is routed to it:
    the finished row stays in the batch until a quarter of it has finished, and every
    decode step routes all of its rows (a pin freed before made the next step fail for
    every op in the batch: "no adapter or snapshot with id 'pin:...'")."""
    log = loop.log
    models = [f"m-p{i}" for i in range(8)]
    for m in models:
        create(loop, m)
    ops = [sample_op(f"chat{i}", 2 if i == 0 else 24, i, adapter=m) for i, m in enumerate(models)]
    for op in ops:
        loop.submit(op)
    log.wait(lambda: {op.request_id for op in ops} <= log.outcomes.keys())
    assert all(log.outcomes[op.request_id].succeeded for op in ops), [
        log.outcomes[op.request_id].error for op in ops
    ]
    assert log.at_step["chat0"] < log.at_step["chat1"]  # it ended while the others decoded
    for op in ops:  # each row sampled what it samples alone on its session's weights
        want = engine.sample([op.payload.request])[0].sequences[0].tokens
        assert log.outcomes[op.request_id].result.sequences[0].tokens == want
    assert not [k for k in engine.bank.snapshots if k.startswith("pin:")]  # all freed


def test_a_sample_answers_from_the_weights_it_arrived_with(make_loop, engine):
    """A chat on a live session waits for room in a full decode batch while an optim_step
    filed after it runs: it still answers from the weights it was filed against."""
    loop = make_loop(max_sample_batch=1)
    log = loop.log
    create(loop, "m-c")
    loop.submit(train_op("m-c", 1))
    log.wait(lambda: "m-c:1" in log.outcomes)
    engine.snapshot("m-c", "before")  # the loop is idle
    loop.submit(sample_op("long", max_tokens=96, seed=1, stream=True))
    log.wait(lambda: streamed_tokens(log, "long") >= 2)
    loop.submit(sample_op("chat", max_tokens=32, seed=7, adapter="m-c"))
    loop.submit(train_op("m-c", 2, OpKind.OPTIM_STEP))
    log.wait(lambda: {"chat", "m-c:2"} <= log.outcomes.keys())
    # the step ran while the batch had no room for the chat
    assert log.at_step["m-c:2"] < log.at_step["long"] <= log.at_step["chat"]
    before = engine.sample([sample_op("x", 32, 7, adapter="before").payload.request])[0]
    after = engine.sample([sample_op("y", 32, 7, adapter="m-c").payload.request])[0]
    chat = log.outcomes["chat"].result.sequences[0]
    assert chat.tokens == before.sequences[0].tokens
    assert chat.logprobs == pytest.approx(before.sequences[0].logprobs, abs=1e-5)
    assert chat.tokens != after.sequences[0].tokens
    engine.drop_snapshot("before")
    assert not [k for k in engine.bank.snapshots if k.startswith("pin:")]


def test_a_sampler_dropped_mid_generation_is_freed_when_it_ends(loop, engine, tmp_path):
    log = loop.log
    create(loop, "m-c")
    engine.save_adapter("m-c", tmp_path / "ck")
    loop.control("load_sampler", ref="ck:1", checkpoint_type="sampler", directory=str(tmp_path / "ck")).result(WAIT)  # fmt: skip
    loop.submit(sample_op("gen", max_tokens=64, seed=7, adapter="ck:1", stream=True))
    log.wait(lambda: streamed_tokens(log, "gen") >= 2)
    loop.control("drop_ref", ref="ck:1").result(WAIT)
    assert not loop.executor.is_live("ck:1") and "ck:1" in engine.bank  # gone for new requests only
    log.wait(lambda: "gen" in log.outcomes)
    assert len(log.outcomes["gen"].result.sequences[0].tokens) == 64
    assert "ck:1" not in engine.bank
    want = engine.sample([sample_op("x", 64, 7, adapter="m-c").payload.request])[0]
    assert log.outcomes["gen"].result.sequences[0].tokens == want.sequences[0].tokens


def test_a_model_unloaded_with_its_snapshot_still_deferred_is_freed(engine, tmp_path):
    """A state snapshot waits for an idle moment, which a running generation does not give:
    a session ended meanwhile is unloaded all the same (the snapshot of a model being freed
    is dropped), and the generation of another goes on."""
    log, snapshots = Log(engine), []
    executor = OpExecutor(engine, writer=None, state_root=tmp_path)
    loop = EngineLoop(
        EngineFacts.of("tiny", engine),
        executor,
        log.outcome,
        on_progress=log.on_progress,
        on_snapshot=snapshots.append,
        snapshots=SnapshotPolicy(every_steps=1),
    )
    loop.log = log
    loop.start()
    try:
        create(loop, "m-s")
        loop.submit(sample_op("long", max_tokens=512, seed=3, stream=True))
        log.wait(lambda: streamed_tokens(log, "long") >= 2)
        loop.submit(train_op("m-s", 1))
        loop.submit(train_op("m-s", 2, OpKind.OPTIM_STEP))
        log.wait(lambda: "m-s:2" in log.outcomes)  # its snapshot is due: deferred
        assert "long" not in log.outcomes  # still decoding: no idle moment yet
        loop.control("unload_model", model_id="m-s", reason="session ended").result(WAIT)
        assert "m-s" not in engine.bank.adapters
        log.wait(lambda: "long" in log.outcomes)
        assert log.outcomes["long"].error is None
        assert snapshots == []  # nothing written for a model that is gone
    finally:
        loop.stop()
        log.close()


def test_a_sample_of_a_sampler_still_to_be_replayed_waits_for_it(loop, engine):
    """A restart's recovery queues a model's replays, then its unfinished samples: a sample
    of a sampler made after the model's last state snapshot (a
    save_weights_and_get_sampling_client acknowledged just before the crash) waits until the
    replay has made its weights again, and then samples from them."""
    log = loop.log
    loop.add_model("m-r")
    snap = Snapshot("smp-r", 0, "s", "tiny", "t")
    replays = [
        Op("m-r:0", OpKind.CREATE, CreateAdapter(LoraSpec(rank=4, seed=2)), "m-r", 0),
        train_op("m-r", 1),
        train_op("m-r", 2, OpKind.OPTIM_STEP),
        Op("m-r:3", OpKind.SNAPSHOT, snap, "m-r", 3),
    ]
    for op in replays:
        op.replay = True
    asleep, woke = threading.Event(), threading.Event()
    loop.call(lambda: (asleep.set(), woke.wait(WAIT)))  # everything arrives in one round
    asleep.wait(WAIT)
    for op in replays:
        loop.submit(op)
    loop.submit(sample_op("after", max_tokens=8, seed=4, adapter="snap:smp-r"))
    woke.set()
    log.wait(lambda: "after" in log.outcomes)
    assert log.outcomes["after"].error is None, log.outcomes["after"].error
    want = engine.sample([sample_op("x", 8, 4, adapter="snap:smp-r").payload.request])[0]
    assert log.outcomes["after"].result.sequences[0].tokens == want.sequences[0].tokens
    loop.control("unload_model", model_id="m-r", reason="done").result(WAIT)


def test_yield_decode_gives_way_to_runnable_ops_only():
    runnable = {"a": ModelQueue(next_seq=3, pending={3: train_op("a", 3)})}
    parked = {"a": ModelQueue(next_seq=1, pending={3: train_op("a", 3)})}  # seq 1 missing
    waiting = [sample_op("s", 4, 0)]
    assert yield_decode(runnable, [], room=0)
    assert not yield_decode(parked, [], room=8)
    assert yield_decode(parked, waiting, room=1)  # it joins in the next round
    assert not yield_decode(parked, waiting, room=0)  # the batch is full: decoding goes on


# ---- cancellation (cancel_future) ----------------------------------------------------------


def test_a_cancelled_generation_leaves_the_batch_between_decode_steps(loop, engine):
    """The other rows of the batch go on exactly as alone; the cancelled op fails, metered
    for its prompt and the tokens it had sampled, and its slot is free."""
    log = loop.log
    loop.submit(sample_op("doomed", max_tokens=500, seed=8, n=2, stream=True))
    loop.submit(sample_op("kept", max_tokens=40, seed=9, stream=True))
    log.wait(lambda: streamed_tokens(log, "doomed") >= 2 * 3 and streamed_tokens(log, "kept") >= 3)
    assert loop.control("cancel", request_ids=["doomed", "nobody"]).result(WAIT) == ["doomed"]
    log.wait(lambda: {"doomed", "kept"} <= log.outcomes.keys())
    doomed = log.outcomes["doomed"]
    assert doomed.error is not None and doomed.error.type == "RequestCancelledError"
    assert doomed.usage.prompt_tokens == 4
    sampled = doomed.usage.sampled_tokens
    assert streamed_tokens(log, "doomed") <= sampled < 2 * 500
    assert loop.executor.sampling == 0  # its rows left: nothing decodes once "kept" ended
    want = engine.sample([sample_op("k", 40, 9).payload.request])[0].sequences[0]
    got = log.outcomes["kept"].result.sequences[0]
    assert got.tokens == want.tokens
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    # cancelling what already finished stops nothing
    assert loop.control("cancel", request_ids=["kept"]).result(WAIT) == []


def test_a_cancelled_training_op_is_skipped_and_the_ops_after_it_run(loop):
    log = loop.log
    create(loop, "m-c")
    for seq in (2, 3):  # parked behind seq 1, which has not arrived
        loop.submit(train_op("m-c", seq))
    assert loop.control("cancel", request_ids=["m-c:2"]).result(WAIT) == ["m-c:2"]
    loop.submit(train_op("m-c", 1))
    log.wait(lambda: {"m-c:1", "m-c:2", "m-c:3"} <= log.outcomes.keys())
    assert log.outcomes["m-c:1"].succeeded and log.outcomes["m-c:3"].succeeded
    skipped = log.outcomes["m-c:2"]
    assert skipped.error.type == "RequestCancelledError" and skipped.usage.train_tokens == 0
    # the model's order holds: 1 ran before 3, and 2 in its place between them
    assert log.at_step["m-c:1"] <= log.at_step["m-c:2"] <= log.at_step["m-c:3"]


def test_a_queued_sample_op_is_cancelled_before_it_runs(make_loop):
    loop = make_loop(max_sample_batch=1)
    log = loop.log
    loop.submit(sample_op("first", max_tokens=200, seed=10, stream=True))
    log.wait(lambda: streamed_tokens(log, "first") >= 2)
    loop.submit(sample_op("waiting", max_tokens=200, seed=11))  # the batch is full
    assert loop.control("cancel", request_ids=["waiting"]).result(WAIT) == ["waiting"]
    log.wait(lambda: "waiting" in log.outcomes)
    waiting = log.outcomes["waiting"]
    assert waiting.error.type == "RequestCancelledError"
    assert (waiting.usage.prompt_tokens, waiting.usage.sampled_tokens) == (0, 0)  # nothing ran
    assert "first" not in log.outcomes or log.outcomes["first"].succeeded
    log.wait(lambda: "first" in log.outcomes)
    assert len(log.outcomes["first"].result.sequences[0].tokens) == 200


def test_a_sample_filed_while_a_round_holds_its_arrivals_is_held_once(loop, engine):
    """A chat on a live session filed while the round pins the weights of the ops that
    arrived before it: it is held once, and its pin freed when it ends (held again by the
    next round after it had ended, its pin would stay in memory for good)."""
    log = loop.log
    create(loop, "m-h")
    executor, hold = loop.executor, loop.executor.hold
    late = [sample_op("late", max_tokens=2, seed=3, adapter="m-h")]

    def hold_and_file(ops):  # the engine thread, between taking arrivals and running them
        hold(ops)
        if late and any(op.request_id == "first" for op in ops):
            loop.submit(late.pop())

    executor.hold = hold_and_file
    loop.submit(sample_op("first", max_tokens=2, seed=2, adapter="m-h"))
    log.wait(lambda: {"first", "late"} <= log.outcomes.keys())
    loop.submit(sample_op("next", max_tokens=2, seed=4))  # one more round
    log.wait(lambda: "next" in log.outcomes)
    assert all(log.outcomes[r].succeeded for r in ("first", "late", "next"))
    assert not executor._held
    assert not [k for k in engine.bank.snapshots if k.startswith("pin:")]
