"""Paced rollouts (treadle.cookbook.rl_pacing) against a fake sampler whose slow problems
take many times longer than the rest: every group is trained within max_steps_off_policy
steps of the policy that sampled it, oldest first, none is discarded (slow ones included),
and the rollouts left when the pool stops are cancelled."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field

from treadle import SamplingParams
from treadle.client.futures import APIFuture
from treadle.cookbook.rl_pacing import PacedPool
from treadle.cookbook.rl_types import Env, RLDataset, StepResult


@dataclass
class Cfg:
    max_steps_off_policy: int = 1
    batch_size: int = 2
    rollout_workers: int = 4
    group_size: int = 1


class OneTurn(Env):
    def __init__(self, slow: bool):
        self.slow = slow

    def initial_observation(self) -> list[int]:
        return [1, 2, 3, 9 if self.slow else 0]

    def step(self, action_tokens):
        return StepResult(reward=1.0)


class Data(RLDataset):
    """Two problems per data step; the first of every second step is slow."""

    def get_batch(self, step):
        return [lambda g, s=(step % 2 == 0 and i == 0): [OneTurn(s)] * g for i in range(2)]


@dataclass
class Seq:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str = "stop"


@dataclass
class Resp:
    sequences: list[Seq]


@dataclass
class FakeSampler:
    """Answers after 0.3 s for a slow prompt, 0.01 s for the others; a cancel ends it."""

    futures: list = field(default_factory=list)

    def sample(self, prompt, num_samples, sampling_params):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        delay = 0.3 if list(prompt)[-1] == 9 else 0.01

        def finish():
            time.sleep(delay)
            if not fut.done():
                fut.set_result(Resp([Seq([5] * (40 if delay > 0.1 else 4), [-0.1])] * num_samples))

        threading.Thread(target=finish, daemon=True).start()
        out = APIFuture(fut, on_cancel=lambda: None)
        self.futures.append(out)
        return out


def test_paced_groups_are_never_too_stale_and_none_is_discarded():
    cfg = Cfg()
    pool = PacedPool(Data(), cfg, params=SamplingParams(max_tokens=8), grade_pool=None)
    sampler = FakeSampler()
    pool.start(sampler, 0, 0)
    trained = []
    try:
        for step in range(8):
            got = []
            while len(got) < cfg.batch_size or pool.has_due(step):
                res = pool.next_for(step)
                if res is not None:
                    got.append(res)
            # a due group (it cannot wait another step) comes before any other
            due = [step - r.version >= cfg.max_steps_off_policy for r in got]
            assert due == sorted(due, reverse=True)
            trained += [(step, r) for r in got]
            time.sleep(0.05)  # training: the rollouts go on meanwhile
            pool.publish(sampler, step + 1)
    finally:
        pool.stop()
    lags = [step - r.version for step, r in trained]
    assert max(lags) <= cfg.max_steps_off_policy
    slow = [r for _, r in trained if r.trajectories[0].transitions[0].action == [5] * 40]
    assert len(slow) >= 3  # the slow problems are trained, not starved
    # nothing finished was thrown away: every finished group's tokens were trained
    tokens = sum(len(r.trajectories[0].transitions[0].action) for _, r in trained)
    assert pool.sampled_tokens == tokens + sum(
        len(r.trajectories[0].transitions[0].action) for r in pool._finished
    )
    # the pipeline overlapped: groups of the next policy were sampled while one was trained
    assert any(lag == 1 for lag in lags)


def test_stop_cancels_the_rollouts_in_flight():
    cfg = Cfg(rollout_workers=2)

    class AllSlow(RLDataset):
        def get_batch(self, step):
            return [lambda g: [OneTurn(True)] * g for _ in range(2)]

    class NeverAnswers(FakeSampler):
        def sample(self, prompt, num_samples, sampling_params):
            cancelled = []
            fut: concurrent.futures.Future = concurrent.futures.Future()
            out = APIFuture(fut, on_cancel=lambda: cancelled.append(True))
            out.cancelled_on_server = cancelled
            self.futures.append(out)
            return out

    sampler = NeverAnswers()
    pool = PacedPool(AllSlow(), cfg, params=SamplingParams(max_tokens=8), grade_pool=None)
    pool.start(sampler, 0, 0)
    deadline = time.monotonic() + 10
    while len(sampler.futures) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    pool.stop(timeout=10)
    assert len(sampler.futures) == 2
    assert all(f.future().cancelled() and f.cancelled_on_server for f in sampler.futures)
    assert pool.cancelled == 2 and pool.sampled_tokens == 0
