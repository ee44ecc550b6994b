"""Advantages, masks and Datum building, against values worked out by hand."""

import numpy as np
import pytest

from treadle import SamplingParams
from treadle.cookbook.rl import (
    build_datums,
    group_advantages,
    request_seed,
    rollout_groups,
    trajectory_to_datum,
)
from treadle.cookbook.rl_types import Env, StepResult, Trajectory, Transition


def test_group_advantages_mean_only():
    np.testing.assert_allclose(group_advantages([1, 0, 0, 1], False), [0.5, -0.5, -0.5, 0.5])


def test_group_advantages_std_normalised():
    # mean 0.25, population std sqrt(0.1875) = 0.4330127
    adv = group_advantages([1, 0, 0, 0], True)
    np.testing.assert_allclose(
        adv, [0.75 / 0.4330127, -0.25 / 0.4330127, *[-0.25 / 0.4330127] * 2], rtol=1e-6
    )


def test_group_advantages_constant_group_is_zero():
    np.testing.assert_array_equal(group_advantages([1, 1, 1], True), [0, 0, 0])


def test_single_turn_datum_masks_prompt():
    t = Trajectory([Transition([5, 6, 7], [8, 9], [-0.5, -0.25], 1.0, {})])
    d = trajectory_to_datum(t, advantage=2.0, scale=0.5)
    assert d.model_input.to_ints() == [5, 6, 7, 8]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [6, 7, 8, 9]
    assert d.loss_fn_inputs["logprobs"].tolist() == [0.0, 0.0, -0.5, -0.25]
    assert d.loss_fn_inputs["advantages"].tolist() == [0.0, 0.0, 1.0, 1.0]


def test_two_turn_datum_is_one_sequence():
    first = Transition([1, 2], [3], [-0.1], 0.0, {})
    second = Transition([1, 2, 3, 4, 5], [6, 7], [-0.2, -0.3], 1.0, {})
    d = trajectory_to_datum(Trajectory([first, second]), advantage=1.0)
    assert d.model_input.to_ints() == [1, 2, 3, 4, 5, 6]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4, 5, 6, 7]
    np.testing.assert_allclose(d.loss_fn_inputs["advantages"].tolist(), [0, 1, 0, 0, 1, 1])
    np.testing.assert_allclose(d.loss_fn_inputs["logprobs"].tolist(), [0, -0.1, 0, 0, -0.2, -0.3])


def test_multi_turn_must_extend_context():
    bad = Trajectory([Transition([1, 2], [3], [-0.1], 0, {}), Transition([9], [4], [-1], 1, {})])
    with pytest.raises(ValueError, match="extend"):
        trajectory_to_datum(bad, 1.0)


def test_build_datums_drops_constant_groups_and_scales_by_tokens():
    def traj(reward, n_action):
        return Trajectory([Transition([1], [2] * n_action, [-1.0] * n_action, reward, {})])

    groups = [[traj(1, 2), traj(0, 2)], [traj(1, 3), traj(1, 3)]]
    datums, stats = build_datums(groups, normalize_std=False, remove_constant=True)
    assert stats == {"groups_constant": 1.0, "datums": 2.0}
    # kept: 4 action tokens in all; advantages +0.5 / -0.5, scaled by 1/4
    assert datums[0].loss_fn_inputs["advantages"].tolist() == [0.125, 0.125]
    assert datums[1].loss_fn_inputs["advantages"].tolist() == [-0.125, -0.125]


class _RecordingSampler:
    """Records the sampling params of each request; answers with empty sequences."""

    def __init__(self):
        self.seeds: list[int | None] = []

    def sample(self, prompt, num_samples, sampling_params):
        from concurrent.futures import Future

        from treadle import SampledSequence, SampleResponse

        self.seeds.append(sampling_params.seed)
        future = Future()
        seqs = [SampledSequence(stop_reason="stop", tokens=[], logprobs=[])] * num_samples
        future.set_result(SampleResponse(sequences=seqs))
        return future


class _OneTurn(Env):
    def __init__(self, prompt):
        self.prompt = prompt

    def initial_observation(self):
        return self.prompt

    def step(self, action_tokens):
        return StepResult(reward=0.0, done=True)


def test_seeded_rollouts_give_every_problem_its_own_seed():
    # One seed for all requests would give every problem the same random draws (correlated
    # errors); each group (and each turn) must get a seed of its own, the same on every run.
    builders = [lambda g, i=i: [_OneTurn([1, 2, i]) for _ in range(g)] for i in range(20)]
    runs = []
    for _ in range(2):
        sampler = _RecordingSampler()
        rollout_groups(sampler, builders, 4, SamplingParams(max_tokens=4, seed=7))
        runs.append(sampler.seeds)
    assert len(set(runs[0])) == 20 and runs[0] == runs[1]
    assert request_seed(7, 0, [1, 2]) != request_seed(7, 0, [1, 2, 3])  # a later turn differs
    unseeded = _RecordingSampler()
    rollout_groups(unseeded, builders, 4, SamplingParams(max_tokens=4))
    assert unseeded.seeds == [None] * 20
