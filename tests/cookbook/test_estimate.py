"""Cost before the run: the estimate of a recipe's run (ServiceClient.estimate_cost over the
recipe's plan, and `treadle estimate`) against the metered usage of the same run on a server
with a price table. SFT's tokens are fixed by its data: estimated exactly. RL's completions
are not: the metered tokens and cost fall within the range the estimate states, and its
prompts (fixed by the data) are exact. The recipe prints the estimate as it starts, and
logs its metered cost per step and in total.

    .venv/bin/python -m pytest -q tests/cookbook/test_estimate.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from treadle import ServiceClient
from treadle.client.estimate import COUNTERS
from treadle.cookbook.recipes import chat_sft, math_rl

MODEL = "treadle/tiny-llama"
PRICE = {"prefill": 0.5, "sample": 2.0, "train": 3.0}  # $ per million tokens


@pytest.fixture(scope="module")
def priced_server(tiny_model_dir, tmp_path_factory):
    from treadle.launch import ServerProcess

    server = ServerProcess(
        {MODEL: tiny_model_dir},
        tmp_path_factory.mktemp("priced"),
        config={"prices": {MODEL: PRICE}},
        startup_timeout_s=180,
    ).start()
    yield server
    server.stop()


def metered(svc: ServiceClient, session_id: str) -> dict:
    (row,) = [r for r in svc.get_usage(by="session")["rows"] if r["key"] == session_id]
    return row


def run_session(run) -> str:
    return run.session_id


def test_sft_estimate_is_the_metered_cost(priced_server, tmp_path, capsys):
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Say {i} " * (i % 5 + 1)},
                {"role": "assistant", "content": f"{i}"},
            ]
        }
        for i in range(20)
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = chat_sft.Config(
        model=MODEL,
        dataset=str(data),
        run_dir=str(tmp_path / "run"),
        base_url=priced_server.url,
        n_test=4,
        batch_size=3,
        max_length=48,
        max_steps=4,
        eval_every=2,
        save_every=0,
    )
    with ServiceClient(base_url=priced_server.url) as svc:
        est = svc.estimate_cost(chat_sft.plan_run(cfg, svc))
        train = est.plan.tokens["train"]
        assert train.low == train.expected == train.high > 0  # SFT: fixed by the data
        run = chat_sft.main(cfg)
        usage = metered(svc, run_session(run))
    assert usage["train_tokens"] == train.expected
    assert usage["prefill_tokens"] == usage["sample_tokens"] == 0
    assert usage["cost_usd"] == pytest.approx(est.cost_usd.expected, rel=1e-6)
    assert est.cost_usd.expected == pytest.approx(train.expected * PRICE["train"] / 1e6)
    # the run printed the estimate as it started, and logged its cost as it went
    assert est.summary() in capsys.readouterr().out
    steps = run.metrics()
    assert sum(m["cost/step_usd"] for m in steps) == pytest.approx(usage["cost_usd"], rel=1e-6)
    assert steps[-1]["cost/total_usd"] == pytest.approx(usage["cost_usd"], rel=1e-6)
    assert all(m["cost/step_usd"] > 0 for m in steps)


def test_rl_metered_cost_is_within_the_estimate(priced_server, tmp_path):
    cfg = math_rl.Config(
        model=MODEL,
        run_dir=str(tmp_path / "run"),
        base_url=priced_server.url,
        prompt_format="raw",
        batch_size=2,
        group_size=4,
        max_tokens=12,
        max_steps=2,
        eval_every=1,
        n_test=3,
        eval_samples=2,
        save_every=0,
    )
    with ServiceClient(base_url=priced_server.url) as svc:
        est = svc.estimate_cost(math_rl.plan_run(cfg, svc))
        run = math_rl.main(cfg)
        usage = metered(svc, run_session(run))
    tokens = est.plan.tokens
    prefill = tokens["prefill"]
    # every prompt token is metered once, prefilled or held by the prefix cache
    assert usage["prefill_tokens"] + usage["cached_prefill_tokens"] == prefill.high
    for counter in COUNTERS:
        assert usage[f"{counter}_tokens"] in tokens[counter], counter
    assert tokens["sample"].low < tokens["sample"].high  # the completions: bounded
    assert usage["cost_usd"] in est.cost_usd
    assert est.cost_usd.low < est.cost_usd.expected < est.cost_usd.high


def test_the_cli_prints_the_same_estimate(priced_server, tmp_path):
    cfg = {
        "model": MODEL,
        "run_dir": str(tmp_path / "r"),
        "prompt_format": "raw",
        "batch_size": 2,
        "group_size": 4,
        "max_tokens": 12,
        "max_steps": 2,
        "eval_every": 0,
    }
    path = tmp_path / "math.json"
    path.write_text(json.dumps(cfg))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "treadle.cli",
            "estimate",
            "--recipe",
            "math_rl",
            "--config",
            str(path),
            "--base-url",
            priced_server.url,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    with ServiceClient(base_url=priced_server.url) as svc:
        want = svc.estimate_cost(math_rl.plan_run(math_rl.Config(**cfg), svc)).to_json()
    assert got == want
    assert got["price_per_million"] == PRICE
