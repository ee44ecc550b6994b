"""The code RL recipe, 2 steps against a real server, one-turn and two-turn: loop mechanics,
metric lines, datums, checkpoints and resume (the tiny model writes no working code)."""

from __future__ import annotations

import json

import pytest

from treadle import ServiceClient
from treadle.cookbook.code_env import CodeDataset, CodeEnv
from treadle.cookbook.recipes import code_rl
from treadle.cookbook.rl_overlap import train_rl_overlapped

MODEL = "treadle/tiny-llama"
STEP_KEYS = {
    "train/reward",
    "train/pass_rate",
    "train/tokens",
    "train/datums",
    "train/groups_used",
    "train/groups_requeued",
    "train/groups_dropped",
    "train/staleness_0",
    "time/sample_s",
    "time/grade_s",
    "time/train_s",
}


def _config(server, run_dir, **kw) -> code_rl.Config:
    base = dict(
        model=MODEL,
        run_dir=str(run_dir),
        base_url=server.url,
        batch_size=2,
        group_size=2,
        max_tokens=12,
        n_test=1,
        eval_samples=1,
        rollout_workers=2,
        sandbox_workers=2,
        unsafe_local_sandbox=True,  # the box where bubblewrap works; tests/sandbox tests it
        remove_constant_reward_groups=False,  # random text scores -0.1 everywhere: train anyway
        stream_groups=1,
    )
    return code_rl.Config(**{**base, **kw})


def _check_train_lines(lines: list[dict], batch_size: int, group_size: int, k: int = 1) -> None:
    for m in lines:
        keys = STEP_KEYS | {f"train/staleness_{lag}" for lag in range(k + 1)}
        assert keys <= set(m), keys - set(m)
        assert m["train/groups_used"] == batch_size
        assert m["train/datums"] == batch_size * group_size  # kept, advantage 0
        assert m["train/fwd_bwd_calls"] == batch_size  # one sub-batch per group, streamed
        assert sum(m[f"train/staleness_{lag}"] for lag in range(k + 1)) == batch_size
        assert m["train/tokens"] > 0
        assert -0.1 <= m["train/reward"] <= 1.0


def test_one_turn_two_steps_then_resume(treadle_server, tmp_path):
    run_dir = tmp_path / "run"
    cfg = _config(treadle_server, run_dir, max_steps=1, save_every=1, eval_every=2)
    run = code_rl.main(cfg)
    assert [m["step"] for m in run.metrics()] == [0, 1]  # step 0, then the final evaluation
    assert {"test/reward", "test/greedy_accuracy"} <= set(run.metrics()[0])
    # extend the same run: it resumes from its checkpoint after step 0
    run = code_rl.main(_config(treadle_server, run_dir, max_steps=2, save_every=1, eval_every=2))
    lines = run.metrics()
    train = [m for m in lines if "train/reward" in m]
    assert [m["step"] for m in train] == [0, 1]
    _check_train_lines(train, 2, 2)
    records = [
        json.loads(line) for line in (run_dir / "checkpoints.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2]
    assert json.loads((run_dir / "config.json").read_text())["loss_fn"] == "cispo"


def test_two_turn_two_steps_with_drop(treadle_server, tmp_path):
    cfg = _config(
        treadle_server,
        tmp_path / "run",
        two_turn=True,
        max_steps=2,
        save_every=0,
        eval_every=0,
        stale_policy="drop",
        max_tokens=10,
    )
    lines = code_rl.main(cfg).metrics()
    assert [m["step"] for m in lines] == [0, 1]
    _check_train_lines(lines, 2, 2)
    assert all(m["train/groups_requeued"] == 0 for m in lines)


class _AlwaysChecks(CodeEnv):
    """Takes every first answer as a check_solution call (the tiny model never writes one), so
    the second turn really goes through the server."""

    def step(self, action_tokens: list[int]):
        if self.turn == 0:
            self.turn += 1
            draft = self.renderer.tokenizer.decode(action_tokens, skip_special_tokens=True)
            return self._check(draft, action_tokens)
        return super().step(action_tokens)


def test_second_turn_through_the_server_synchronous(treadle_server, tmp_path):
    cfg = _config(treadle_server, tmp_path / "run", two_turn=True, max_steps=2, save_every=0)
    cfg.max_steps_off_policy, cfg.eval_every, cfg.max_tokens = 0, 0, 8
    sandbox = code_rl.make_sandbox(cfg)

    class Dataset(CodeDataset):
        def builder(self, problem):
            return lambda g: [
                _AlwaysChecks(problem, self.renderer, self.settings) for _ in range(g)
            ]

    def make(tokenizer):
        base = code_rl.make_dataset_fn(cfg, sandbox)(tokenizer)
        return Dataset(base.train, base.test, base.renderer, base.settings, cfg.batch_size)

    try:
        with ServiceClient(base_url=treadle_server.url) as svc:
            run = train_rl_overlapped(code_rl.overlap_config(cfg), make, service=svc)
    finally:
        sandbox.close()
    lines = run.metrics()
    _check_train_lines(lines, 2, 2, k=0)
    for m in lines:
        assert m["train/tool_calls"] == 1.0 and m["time/grade_s"] > 0  # the check really ran
        assert m["train/tokens"] >= 2 * 2 * 2  # two turns per episode
        # k = 0 is the synchronous loop: every group fresh, nothing requeued or dropped
        assert m["train/staleness_0"] == 2 and m["train/groups_requeued"] == 0


def test_flags():
    from treadle.cookbook.config_cli import parse_config

    argv = ["--model", "m", "--max_steps_off_policy", "2", "--stale_policy", "drop"]
    cfg = parse_config(code_rl.Config, [*argv, "--two_turn", "true", "--sandbox", "http://h:8080"])
    assert (cfg.max_steps_off_policy, cfg.stale_policy, cfg.two_turn) == (2, "drop", True)
    assert cfg.loss_fn == "cispo" and cfg.dataset == "builtin"
    remote = code_rl.make_sandbox(cfg)
    assert remote.url == "http://h:8080/run_code"
    remote.close()


def test_local_sandbox_needs_bubblewrap_unless_told_otherwise(monkeypatch):
    from treadle.cookbook.config_cli import parse_config
    from treadle.sandbox import SandboxUnavailableError, box, local

    monkeypatch.setattr(local, "_probed", None)
    monkeypatch.setattr(box, "find_bwrap", lambda: None)  # as if it were not installed
    cfg = parse_config(code_rl.Config, ["--model", "m"])
    assert cfg.unsafe_local_sandbox is False
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
        code_rl.make_sandbox(cfg)
    cfg = parse_config(code_rl.Config, ["--model", "m", "--unsafe_local_sandbox", "true"])
    sandbox = code_rl.make_sandbox(cfg)
    try:
        assert sandbox.isolation.box is None and sandbox.run("print(2 + 2)").stdout == "4\n"
    finally:
        sandbox.close()
