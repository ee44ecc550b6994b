"""The demo's RL phase learns for three seeds (slow: about 6 minutes a seed on 2 cores).

    .venv/bin/python -m pytest -m slow tests/cookbook/test_demo_learns.py

The gain must clear the evaluation noise: 3 standard errors of one held-out evaluation
(1,200 samples at T=1), and greedy accuracy must not fall by more than 2 of its own (300
problems). `python bench/demo_seeds.py` prints the same figures as a table.
"""

import math

import pytest

from treadle.demo import DemoConfig, run_demo


def standard_error(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-12) / n)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rl_phase_raises_held_out_reward(seed, tiny_model_dir, tmp_path):
    cfg = DemoConfig(seed=seed)
    s = run_demo(model_dir=str(tiny_model_dir), run_dir=str(tmp_path / "demo"), cfg=cfg)
    reward_se = standard_error(s["test_reward_before"], cfg.eval_problems * cfg.eval_samples)
    greedy_se = standard_error(s["greedy_accuracy_before"], cfg.eval_problems)
    assert s["test_reward_after"] - s["test_reward_before"] > 3 * reward_se, s
    assert s["greedy_accuracy_after"] - s["greedy_accuracy_before"] > -2 * greedy_se, s
