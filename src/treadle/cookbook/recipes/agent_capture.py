"""GRPO on a tool-using agent written only against the `openai` client: no tokenizer, no
token ids in this file. The server records every completion of the agent under a capture
session (treadle.client.capture), the loop attaches rewards, and the exported datums (the
tokens as sampled, prompts and tool results masked out) go to forward_backward.

    python -m treadle.cookbook.recipes.agent_capture --model treadle/tiny-llama --max_steps 12
    python -m treadle.cookbook.recipes.agent_capture --model M --reward exact --loss_fn stable_reinforce

The agent answers arithmetic questions and may call a `calculator` tool (the chat template
renders the tool; its <tool_call> answers come back as OpenAI tool_calls). Rewards:
`exact` is 1 when the final answer holds the right number; `digits` (for a random model,
which never calls a tool) is the share of the final answer's characters that are digits,
plus the exact bonus: dense enough for GRPO to move a tiny model within a few steps.
Metrics per step: train/reward (mean over rollouts) and train/reward_se (its standard error),
train/tool_calls, train/datums.
"""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from treadle import AdamParams, ServiceClient
from treadle.cookbook.config_cli import parse_config
from treadle.cookbook.math_env import arithmetic_problems
from treadle.cookbook.run_dir import RunDir

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression of integers, + - * and brackets",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
SAFE = re.compile(r"^[\d\s+\-*()]{1,64}$")


@dataclass
class Config:
    model: str
    run_dir: str = "runs/agent_capture"
    base_url: str | None = None
    api_key: str | None = None
    problems_per_step: int = 4
    group_size: int = 8
    max_turns: int = 2
    max_tokens: int = 24
    temperature: float = 1.0
    reward: str = "digits"  # digits | exact
    normalize_std: bool = True  # GRPO advantages divided by the group's std
    loss_fn: str = "importance_sampling"  # or stable_reinforce (its provenance is recorded)
    learning_rate: float = 3e-3
    lora_rank: int = 16
    max_steps: int = 12
    seed: int = 0


def calculator(arguments: str) -> str:
    try:
        expr = str(json.loads(arguments).get("expression", ""))
    except (json.JSONDecodeError, AttributeError):
        return "error: arguments must be a JSON object with an expression"
    if not SAFE.match(expr):
        return "error: only integers, + - * and brackets"
    try:
        return str(eval(expr, {"__builtins__": {}}))  # noqa: S307 - digits and operators only
    except Exception as e:  # noqa: BLE001 - the agent sees the error, as a tool would report it
        return f"error: {type(e).__name__}"


def run_agent(client, model: str, question: str, cfg: Config) -> tuple[str, int]:
    """One episode: → (the final answer, tool calls made)."""
    messages = [{"role": "user", "content": question}]
    calls = 0
    for _ in range(cfg.max_turns):
        r = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            max_tokens=cfg.max_tokens,
            temperature=cfg.temperature,
        )
        msg = r.choices[0].message
        if not msg.tool_calls:
            return msg.content or "", calls
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            calls += 1
            result = calculator(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return "", calls


def reward_of(answer: str, target: int, kind: str) -> float:
    exact = float(re.search(rf"(?<!\d){target}(?!\d)", answer) is not None)
    if kind == "exact":
        return exact
    digits = sum(c.isdigit() for c in answer) / max(len(answer), 1)
    return digits + exact


def main(cfg: Config) -> RunDir:
    import openai

    run = RunDir(cfg.run_dir, cfg)
    svc = ServiceClient(base_url=cfg.base_url, api_key=cfg.api_key)
    tc = svc.create_lora_training_client(cfg.model, rank=cfg.lora_rank, seed=cfg.seed)
    problems = arithmetic_problems(1000, seed=cfg.seed + 1)
    rng = np.random.default_rng(cfg.seed)
    base_url = svc.transport.base_url + "/v1"
    key = svc.transport.api_key or "tml-local"
    pool = ThreadPoolExecutor(cfg.problems_per_step * cfg.group_size)
    for step in range(cfg.max_steps):
        capture = svc.create_capture_session(f"{tc.model_id}-step{step}")
        picked = [problems[i] for i in rng.choice(len(problems), cfg.problems_per_step, False)]
        jobs = {}
        for p, problem in enumerate(picked):
            for g in range(cfg.group_size):
                tid = f"p{p}-g{g}"
                client = openai.OpenAI(
                    base_url=base_url, api_key=key, default_headers=capture.headers(tid)
                )
                jobs[tid] = (
                    p,
                    problem,
                    pool.submit(run_agent, client, tc.model_id, problem.question, cfg),
                )
        rewards, calls = [], []
        for tid, (p, problem, fut) in jobs.items():
            answer, n_calls = fut.result()
            r = reward_of(answer, problem.answer, cfg.reward)
            rewards.append((tid, r, f"p{p}"))
            calls.append(n_calls)
        capture.set_rewards(rewards)
        datums = capture.export_datums(normalize_std=cfg.normalize_std)
        values = np.array([r for _, r, _ in rewards])
        if datums:
            fb = tc.forward_backward(datums, loss_fn=cfg.loss_fn)
            tc.optim_step(AdamParams(learning_rate=cfg.learning_rate)).result()
            fb.result()
        metrics = {
            "train/reward": float(values.mean()),
            "train/reward_se": float(values.std(ddof=1) / np.sqrt(len(values))),
            "train/tool_calls": float(np.mean(calls)),
            "train/datums": float(len(datums)),
        }
        run.log_metrics(step, metrics)
        print(f"step {step} " + " ".join(f"{k}={v:.3f}" for k, v in metrics.items()), flush=True)
    pool.shutdown()
    run.close()
    svc.close()
    return run


if __name__ == "__main__":
    main(parse_config(Config, sys.argv[1:]))
