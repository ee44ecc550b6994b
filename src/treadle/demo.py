"""`make demo`: a tiny model learns arithmetic through the service, offline, in a few minutes.

1. build the tiny model if it is missing, and start `treadle serve` on a free port;
2. SFT warm-up through the SDK on worked arithmetic answers, some with one wrong step
   (imperfect demonstrations leave the model something that RL can fix);
3. GRPO from the SFT weights with a strict verifier (right number AND valid working),
   printing a per-step table and writing metrics.jsonl and a PNG plot to the run folder.

  treadle demo [--seed 0] [--run-dir runs/demo]

Interrupted (Ctrl-C), it says so in one line; run again, it starts over (the run folder is
made anew, and a model build that was cut short is done again).
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from treadle.arithmetic import problem, worked_answer
from treadle.cookbook.math_env import MathDataset, Prompter, arithmetic_problems
from treadle.cookbook.plot import plot_run
from treadle.cookbook.rl import RLConfig, train_rl
from treadle.cookbook.sft import SFTConfig, render_completion, train_sft

MODEL_NAME = "treadle/tiny-llama"


@dataclass
class DemoConfig:
    seed: int = 0
    # A rank-128 adapter on a 128-wide model: LoRA with the reach of full fine-tuning.
    lora_rank: int = 128
    lora_alpha: float = 128.0
    sft_examples: int = 20_000
    corrupt_frac: float = 0.4
    sft_steps: int = 600
    sft_batch: int = 64
    sft_lr: float = 1e-3
    rl_steps: int = 40
    rl_questions: int = 32
    rl_group: int = 8
    rl_lr: float = 5e-5
    rl_loss: str = "ppo"
    # RL goes on in the SFT session's optimizer: Adam's second moments from SFT damp the
    # first, noisy RL updates (a fresh Adam takes full-size sign-like steps at once).
    rl_keep_adam: bool = True
    eval_every: int = 10
    eval_problems: int = 300
    eval_samples: int = 4
    max_tokens: int = 32


TEST_SEED = 987_654


class DemoError(RuntimeError):
    """The demo cannot go on; the message says why and what to do (one line)."""


def ensure_tiny_model(model_dir: Path, make_tiny_model) -> None:
    """Build the demo's model unless it is there whole. It is built in a folder beside it and
    renamed into place, so an interrupted build leaves nothing the next run mistakes for a
    model; a folder left by an older, interrupted build (config.json but no weights) is
    built again."""
    if (model_dir / "config.json").exists() and any(model_dir.glob("*.safetensors")):
        return
    if model_dir.exists():
        print(f"the model in {model_dir} is incomplete (an interrupted build?): building it again")
        shutil.rmtree(model_dir)
    else:
        print(f"building the tiny model in {model_dir}")
    partial = model_dir.with_name(f".{model_dir.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    make_tiny_model(partial, arch="llama", size="tiny")
    partial.rename(model_dir)


def held_out(cfg: DemoConfig) -> list:
    return arithmetic_problems(cfg.eval_problems, seed=TEST_SEED)


def sft_examples(tokenizer, cfg: DemoConfig) -> list:
    rng = random.Random(cfg.seed + 1)
    test_questions = {p.question for p in held_out(cfg)}
    examples = []
    while len(examples) < cfg.sft_examples:
        question, steps = problem(rng)
        if question in test_questions:
            continue
        answer, _ = worked_answer(steps, rng, corrupt=rng.random() < cfg.corrupt_frac)
        examples.append(
            render_completion(tokenizer, f"Question: {question}\nAnswer:", f" {answer}", 128)
        )
    return examples


def print_row(step: int, m: dict) -> None:
    def fmt(key: str, spec: str) -> str:
        return format(m[key], spec) if key in m else "-"

    tqdm.write(
        f"{step:>5} {fmt('train/reward', '.3f'):>12} {fmt('test/reward', '.3f'):>12} "
        f"{fmt('test/greedy_accuracy', '.3f'):>12} {fmt('train/tokens', '.0f'):>8} "
        f"{m.get('time/sample_s', 0) + m.get('time/train_s', 0):>7.1f}"
    )


def sft_warmup(svc, base_url: str, cfg: DemoConfig, run_path: Path) -> str:
    """The SFT warm-up through the SDK; returns the path of its saved training state."""
    tokenizer = svc.get_tokenizer(MODEL_NAME)
    sft = SFTConfig(
        model=MODEL_NAME,
        run_dir=str(run_path / "sft"),
        base_url=base_url,
        lora_rank=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        learning_rate=cfg.sft_lr,
        batch_size=cfg.sft_batch,
        max_length=128,
        max_steps=cfg.sft_steps,
        eval_every=0,
        save_every=cfg.sft_steps,
        seed=cfg.seed,
    )
    sft_run, _ = train_sft(sft, sft_examples(tokenizer, cfg), service=svc)
    return sft_run.last_checkpoint()["state_path"]


def grpo(svc, base_url: str, cfg: DemoConfig, run_path: Path, sft_state: str):
    """GRPO from the SFT weights with a strict verifier; returns the run folder."""
    rl = RLConfig(
        model=MODEL_NAME,
        run_dir=str(run_path / "rl"),
        base_url=base_url,
        learning_rate=cfg.rl_lr,
        group_size=cfg.rl_group,
        max_tokens=cfg.max_tokens,
        loss_fn=cfg.rl_loss,
        max_steps=cfg.rl_steps,
        eval_every=cfg.eval_every,
        eval_samples=cfg.eval_samples,
        save_every=0,
        seed=cfg.seed,
        load_checkpoint_path=sft_state,
        load_optimizer=cfg.rl_keep_adam,
    )

    def dataset(tok) -> MathDataset:
        test = held_out(cfg)
        test_questions = {p.question for p in test}
        train = [
            p
            for p in arithmetic_problems(5000, seed=cfg.seed + 2)
            if p.question not in test_questions
        ]
        return MathDataset(
            train=train,
            test=test,
            prompter=Prompter(tok, "raw"),
            batch_size=cfg.rl_questions,
            strict=True,
            seed=cfg.seed,
        )

    print(
        f"{'step':>5} {'train reward':>12} {'test reward':>12} {'greedy acc':>12} "
        f"{'tokens':>8} {'seconds':>7}"
    )
    return train_rl(rl, dataset, service=svc, on_step=print_row)


def summarize(rl_run) -> dict[str, float]:
    evals = [m for m in rl_run.metrics() if "test/reward" in m]
    return {
        "test_reward_before": evals[0]["test/reward"],
        "test_reward_after": evals[-1]["test/reward"],
        "greedy_accuracy_before": evals[0]["test/greedy_accuracy"],
        "greedy_accuracy_after": evals[-1]["test/greedy_accuracy"],
    }


def run_demo(
    model_dir: str = ".models/tiny-llama",
    run_dir: str = "runs/demo",
    seed: int = 0,
    port: int = 0,
    cfg: DemoConfig | None = None,
) -> dict[str, float]:
    from treadle import ServiceClient
    from treadle.engine.tiny import make_tiny_model
    from treadle.launch import ServerProcess, ServerStartError

    cfg = cfg or DemoConfig(seed=seed)
    ensure_tiny_model(Path(model_dir), make_tiny_model)
    run_path = Path(run_dir)
    shutil.rmtree(run_path, ignore_errors=True)
    try:
        server = ServerProcess({MODEL_NAME: model_dir}, run_path / "server", port=port).start()
    except ServerStartError as e:
        raise DemoError(
            f"the server did not start: {e.reason.removeprefix('treadle serve: ')} "
            f"(its log: {run_path / 'server' / 'server.log'})"
        ) from None
    try:
        print(f"server up at {server.url}")
        svc = ServiceClient(base_url=server.url)
        print(f"SFT warm-up: {cfg.sft_steps} steps, {cfg.corrupt_frac:.0%} imperfect demos")
        sft_state = sft_warmup(svc, server.url, cfg, run_path)
        print("GRPO with a strict verifier")
        rl_run = grpo(svc, server.url, cfg, run_path, sft_state)
        svc.close()
    finally:
        server.stop()
    plots = plot_run(rl_run.path, keys=["train/reward", "test/reward", "test/greedy_accuracy"])
    summary = summarize(rl_run)
    print(
        f"held-out reward (T=1): {summary['test_reward_before']:.3f} -> "
        f"{summary['test_reward_after']:.3f}; greedy accuracy: "
        f"{summary['greedy_accuracy_before']:.3f} -> {summary['greedy_accuracy_after']:.3f}"
    )
    print(f"metrics: {rl_run.path / 'metrics.jsonl'}  plot: {plots[0]}")
    return summary
