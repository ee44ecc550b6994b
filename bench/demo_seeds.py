"""Does the demo's RL phase really learn? The demo for several seeds, before/after figures.

    python bench/demo_seeds.py [--seeds 0 1 2]

For each seed: SFT warm-up then GRPO through the service (exactly `make demo`), and the
held-out figures at the start and the end of RL. The RL gain counts only if it clears the
evaluation noise: the standard error of the held-out reward (1,200 samples: 300 problems x 4)
and of greedy accuracy (300 problems). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

from treadle.demo import DemoConfig, run_demo


def noise(p: float, n: int) -> float:
    """Standard error of a mean of n Bernoulli(p) outcomes."""
    return math.sqrt(max(p * (1 - p), 1e-12) / n)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--model-dir", default=".models/tiny-llama")
    args = parser.parse_args()

    rows = []
    for seed in args.seeds:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            summary = run_demo(model_dir=args.model_dir, run_dir=str(Path(tmp) / "demo"), seed=seed)
        rows.append({"seed": seed, "seconds": time.monotonic() - t0, **summary})

    cfg = DemoConfig()
    n_sampled, n_greedy = cfg.eval_problems * cfg.eval_samples, cfg.eval_problems
    print(
        f"\n{'seed':>4} {'reward before':>14} {'after':>7} {'gain':>7} "
        f"{'greedy before':>14} {'after':>7} {'seconds':>8}"
    )
    for r in rows:
        r["reward_gain"] = r["test_reward_after"] - r["test_reward_before"]
        r["greedy_change"] = r["greedy_accuracy_after"] - r["greedy_accuracy_before"]
        r["reward_noise"] = noise(r["test_reward_before"], n_sampled)
        r["greedy_noise"] = noise(r["greedy_accuracy_before"], n_greedy)
        print(
            f"{r['seed']:>4} {r['test_reward_before']:>14.3f} {r['test_reward_after']:>7.3f} "
            f"{r['reward_gain']:>+7.3f} {r['greedy_accuracy_before']:>14.3f} "
            f"{r['greedy_accuracy_after']:>7.3f} {r['seconds']:>8.0f}"
        )
    gains = [r["reward_gain"] for r in rows]
    greedy = [r["greedy_change"] for r in rows]
    result = {
        "reward_gain_mean": statistics.mean(gains),
        "reward_gain_std": statistics.stdev(gains) if len(gains) > 1 else 0.0,
        "greedy_change_mean": statistics.mean(greedy),
        "greedy_change_std": statistics.stdev(greedy) if len(greedy) > 1 else 0.0,
        # "clearly beyond noise": every seed's gain above 3 standard errors of one evaluation
        "all_gains_beyond_noise": all(r["reward_gain"] > 3 * r["reward_noise"] for r in rows),
        "no_greedy_drop_beyond_noise": all(
            r["greedy_change"] > -2 * r["greedy_noise"] for r in rows
        ),
        "seconds_mean": statistics.mean(r["seconds"] for r in rows),
        "rows": rows,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
