"""Steps per second of the overlapped code-RL loop against the synchronous loop, same settings.

    .venv/bin/python bench/code_rl.py                 # tiny-llama, 4 problems x 4 samples, 6 steps
    .venv/bin/python bench/code_rl.py --steps 4 --rounds 1

Both modes are the same loop (treadle.cookbook.rl_overlap) on the same problems, sampling
settings, workers and sandbox; only `max_steps_off_policy` differs: 0 is the synchronous loop
(sampling of a step starts once the previous step's weights are published), 1 lets the
workers sample and grade the next step while the trainer trains. Every answer is graded in
the local sandbox (an answer without a code block is run as it is), so each step pays for
sampling, grading and training as a real run does. The first step of each run is warm-up
and not counted; modes alternate over --rounds and the best run of each is reported.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from treadle import ServiceClient
from treadle.cookbook.code_env import (
    CodeDataset,
    CodeEnv,
    CodeRenderer,
    GradeSettings,
    builtin_problems,
    extract_code,
)
from treadle.cookbook.rl_overlap import OverlapConfig, train_rl_overlapped
from treadle.cookbook.rl_types import StepResult
from treadle.engine.tiny import make_tiny_model
from treadle.launch import ServerProcess
from treadle.sandbox import LocalSandbox, SandboxLimits

NAME = "bench/tiny-llama"


class GradeEverything(CodeEnv):
    """Runs every answer in the sandbox, code block or not: the grading cost of a model that
    writes code, with a random model."""

    def _final(self, text: str) -> StepResult:
        code = extract_code(text) or text
        verdict = self._grade(code, self.problem.tests)
        return self._end(1.0 if verdict.passed else 0.0, {"pass_rate": verdict.pass_rate})


class BenchDataset(CodeDataset):
    def builder(self, problem):
        return lambda g: [GradeEverything(problem, self.renderer, self.settings) for _ in range(g)]


def run_once(url: str, k: int, args, sandbox, run_dir: Path) -> dict[str, float]:
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
        max_steps_off_policy=k,
        rollout_workers=args.workers,
        remove_constant_reward_groups=False,
        loss_fn="cispo",
    )
    problems = builtin_problems()
    settings = GradeSettings(sandbox, timeout_per_test_s=1.0, max_tokens=args.max_tokens)

    def make(tokenizer):
        return BenchDataset(problems, [], CodeRenderer(tokenizer, False), settings, args.batch_size)

    ends: list[float] = []
    lines: list[dict] = []

    def on_step(step: int, metrics: dict) -> None:
        ends.append(time.perf_counter())
        lines.append(metrics)

    with ServiceClient(base_url=url) as svc:
        train_rl_overlapped(config, make, service=svc, on_step=on_step)
    counted = lines[1:]
    return {
        "steps_per_s": (len(ends) - 1) / (ends[-1] - ends[0]),
        "sample_s": sum(m["time/sample_s"] for m in counted) / len(counted),
        "grade_s": sum(m["time/grade_s"] for m in counted) / len(counted),
        "train_s": sum(m["time/train_s"] for m in counted) / len(counted),
        "staleness_mean": sum(m["train/staleness_mean"] for m in counted) / len(counted),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--group_size", type=int, default=4)
    parser.add_argument("--max_tokens", type=int, default=48)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument(
        "--unsafe_local_sandbox",
        action="store_true",
        help="grade without bubblewrap, as plain processes that are NOT isolated",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", arch="llama", size=args.size)
        server = ServerProcess({NAME: model}, Path(tmp) / "data").start()
        sandbox = LocalSandbox(
            SandboxLimits(timeout_s=5.0), workers=2 * args.workers, unsafe=args.unsafe_local_sandbox
        )
        best: dict[str, dict] = {}
        try:
            for r in range(args.rounds):
                for mode, k in (("sync", 0), ("overlap", 1)):
                    res = run_once(server.url, k, args, sandbox, Path(tmp) / f"{mode}-{r}")
                    print(
                        f"round {r} {mode:8s} " + " ".join(f"{a}={b:.3f}" for a, b in res.items())
                    )
                    if mode not in best or res["steps_per_s"] > best[mode]["steps_per_s"]:
                        best[mode] = res
        finally:
            sandbox.close()
            server.stop()
    result = {
        "bench": "code_rl",
        "model": f"tiny-llama-{args.size}",
        "batch_size": args.batch_size,
        "group_size": args.group_size,
        "max_tokens": args.max_tokens,
        "steps_counted": args.steps - 1,
        "sync_steps_per_s": round(best["sync"]["steps_per_s"], 4),
        "overlap_steps_per_s": round(best["overlap"]["steps_per_s"], 4),
        "overlap_ratio": round(best["overlap"]["steps_per_s"] / best["sync"]["steps_per_s"], 3),
        "overlap_staleness_mean": round(best["overlap"]["staleness_mean"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
