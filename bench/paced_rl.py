"""Pacing against requeueing in the overlapped RL loop (cookbook/rl_overlap.py), on the math
(arithmetic) and code recipes' environments, one step off-policy.

    .venv/bin/python bench/paced_rl.py                      # tiny-llama, 8 steps per run
    .venv/bin/python bench/paced_rl.py --steps 6 --tasks math

For each task, `requeue` (a group back more than k steps old is sampled again) and `pace`
(admission control, oldest finished group first: rl_pacing.py) run the same loop, problems,
seeds and workers on one server, alternating. Reported per run:
- trained_token_frac: tokens of trained groups / tokens of every group sampled to the end
  (requeued ones are sampled and thrown away; cancelled rollouts are not counted);
- reward_per_min: the summed reward of the trained trajectories per wall-clock minute, and
  steps_per_min;
- difficulty of the trained groups: their mean length in tokens (slow rollouts are long
  ones) and mean reward (easy problems score high), against the same figures of every
  group sampled; a loop that favours easy problems trains shorter, higher-reward groups
  than it samples;
- max_lag: the oldest group trained, in steps.
The tiny model's answers are random, so rewards are near 0 on code: the token and length
figures are the ones that say something here. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from treadle import ServiceClient
from treadle.cookbook.code_env import CodeRenderer, GradeSettings, builtin_problems
from treadle.cookbook.math_env import MathDataset, Prompter, arithmetic_problems
from treadle.cookbook.rl_overlap import OverlapConfig, train_rl_overlapped
from treadle.engine.tiny import make_tiny_model
from treadle.launch import ServerProcess
from treadle.sandbox import LocalSandbox, SandboxLimits

sys.path.insert(0, str(Path(__file__).parent))
from code_rl import BenchDataset  # noqa: E402 - the code bench's grade-everything env

NAME = "bench/tiny-llama"


def make_dataset(task: str, args, sandbox):
    if task == "math":
        train = arithmetic_problems(2000, seed=1)

        def make(tok):
            return MathDataset(train, [], Prompter(tok, "raw"), args.batch_size, strict=False)

        return make
    settings = GradeSettings(sandbox, timeout_per_test_s=1.0, max_tokens=args.max_tokens)

    def make(tok):
        problems = builtin_problems()
        return BenchDataset(problems, [], CodeRenderer(tok, False), settings, args.batch_size)

    return make


def run_once(url: str, task: str, policy: str, args, sandbox, run_dir: Path) -> dict:
    config = OverlapConfig(
        model=NAME,
        run_dir=str(run_dir),
        base_url=url,
        batch_size=args.batch_size,
        group_size=args.group_size,
        max_tokens=args.max_tokens,
        max_steps=args.steps,
        eval_every=0,
        save_every=0,
        max_steps_off_policy=1,
        stale_policy=policy,
        rollout_workers=args.workers,
        remove_constant_reward_groups=False,
        loss_fn="cispo",
        seed=args.seed,
    )
    groups: list[dict] = []
    lines: list[dict] = []
    start = time.perf_counter()
    with ServiceClient(base_url=url) as svc:
        train_rl_overlapped(
            config,
            make_dataset(task, args, sandbox),
            service=svc,
            on_step=lambda step, m: lines.append(m),
            on_group=groups.append,
        )
    minutes = (time.perf_counter() - start) / 60
    trained = [g for g in groups if g["trained"]]
    sampled_tokens = lines[-1]["train/sampled_tokens_total"]
    rewards = sum(g["reward"] * args.group_size for g in trained)
    return {
        "trained_token_frac": sum(g["tokens"] for g in trained) / max(sampled_tokens, 1),
        "reward_per_min": rewards / minutes,
        "steps_per_min": args.steps / minutes,
        "trained_len": float(np.mean([g["tokens"] for g in trained])),
        "sampled_len": float(np.mean([g["tokens"] for g in groups])),
        "trained_reward": float(np.mean([g["reward"] for g in trained])),
        "sampled_reward": float(np.mean([g["reward"] for g in groups])),
        "groups_discarded": len(groups) - len(trained),
        "max_lag": max(g["lag"] for g in trained),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tasks", default="math,code")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--group_size", type=int, default=4)
    parser.add_argument("--max_tokens", type=int, default=48)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--unsafe_local_sandbox",
        action="store_true",
        help="grade without bubblewrap, as plain processes that are NOT isolated",
    )
    args = parser.parse_args()
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", arch="llama")
        server = ServerProcess({NAME: model}, Path(tmp) / "data").start()
        sandbox = LocalSandbox(
            SandboxLimits(timeout_s=5.0), workers=2 * args.workers, unsafe=args.unsafe_local_sandbox
        )
        try:
            for task in args.tasks.split(","):
                for policy in ("requeue", "pace"):
                    res = run_once(
                        server.url, task, policy, args, sandbox, Path(tmp) / task / policy
                    )
                    out[f"{task}/{policy}"] = res
                    print(
                        f"{task:5s} {policy:8s} " + " ".join(f"{k}={v:.3f}" for k, v in res.items())
                    )
        finally:
            sandbox.close()
            server.stop()
    print(json.dumps({"bench": "paced_rl", "model": "tiny-llama", "steps": args.steps, **out}))


if __name__ == "__main__":
    main()
