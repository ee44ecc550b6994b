"""Captured turns into datums (treadle.server.core.capture_datums), against hand-built
trajectories: chaining, masks, logprobs, advantages and provenance spans."""

from __future__ import annotations

import numpy as np
import pytest

from treadle.server.core.capture_datums import Turn, advantages, chains, trajectory_datums


def turn(i: int, prompt, tokens, seq: str | None = "s") -> Turn:
    lps = [-0.1 * (k + 1) - i for k in range(len(tokens))]
    return Turn(f"c{i}", list(prompt), list(tokens), lps, f"{seq}{i}" if seq else None, "sess")


def test_turns_that_extend_each_other_are_one_datum_with_only_sampled_tokens_weighted():
    t1 = turn(1, [1, 2, 3], [10, 11])
    t2 = turn(2, [1, 2, 3, 10, 11, 4, 5], [12, 13, 14])  # tool result 4 5, then the answer
    (d,) = trajectory_datums([t1, t2], advantage=2.0)
    tokens = [1, 2, 3, 10, 11, 4, 5, 12, 13, 14]
    assert d.model_input.to_ints() == tokens[:-1]
    x = {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()}
    assert x["target_tokens"].tolist() == tokens[1:]
    sampled = [0, 0, 1, 1, 0, 0, 1, 1, 1]  # targets 2 3 10 11 4 5 12 13 14
    assert x["weights"].tolist() == sampled
    np.testing.assert_allclose(x["advantages"], 2.0 * np.array(sampled))
    np.testing.assert_allclose(x["logprobs"], [0, 0, -1.1, -1.2, 0, 0, -2.1, -2.2, -2.3], rtol=1e-6)
    # provenance: targets are prompt 1[1:3], sampled 1, prompt 2[5:7], sampled 2
    spans = [(s.type, s.sequence_id, s.offset, s.length) for s in d.loss_fn_input_spans]
    assert spans == [
        ("prompt", "s1", 1, 2),
        ("sampled", "s1", 0, 2),
        ("prompt", "s2", 5, 2),
        ("sampled", "s2", 0, 3),
    ]
    inputs = [(s.type, s.sequence_id, s.offset, s.length) for s in d.model_input_spans]
    assert inputs[-1] == ("sampled", "s2", 0, 2) and sum(s[3] for s in inputs) == 9


def test_a_prompt_that_re_renders_an_answer_differently_starts_a_new_datum():
    t1 = turn(1, [1, 2], [10, 11])
    t2 = turn(2, [1, 2, 99, 4], [12])  # the template rendered the answer as 99
    ds = trajectory_datums([t1, t2], advantage=1.0)
    assert len(ds) == 2
    assert ds[1].model_input.to_ints() == [1, 2, 99, 4]
    assert ds[1].loss_fn_inputs["weights"].to_numpy().tolist() == [0, 0, 0, 1]
    assert len(chains([t1, t2])) == 2


def test_no_provenance_without_recorded_sequences():
    (d,) = trajectory_datums([turn(1, [1, 2], [3, 4], seq=None)], advantage=1.0)
    assert d.loss_fn_input_spans is None and d.model_input_spans is None


@pytest.mark.parametrize("normalize", [False, True])
def test_advantages_are_taken_within_groups(normalize):
    rewards = {"a": 1.0, "b": 0.0, "c": 0.5, "d": 3.0}
    groups = {"a": "g", "b": "g", "c": "g", "d": None}
    out = advantages(rewards, groups, normalize)
    r = np.array([1.0, 0.0, 0.5])
    want = r - r.mean()
    if normalize:
        want = want / (r.std() + 1e-6)
    np.testing.assert_allclose([out["a"], out["b"], out["c"]], want)
    assert out["d"] == 3.0
