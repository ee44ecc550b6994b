"""GRPO on math word problems: GSM8K (answer after ####) or offline synthetic arithmetic.

    python -m treadle.cookbook.recipes.math_rl --model treadle/tiny-llama --run_dir runs/math \\
        --dataset arithmetic --max_steps 20
    python -m treadle.cookbook.recipes.math_rl --model Qwen/Qwen3-0.6B --dataset openai/gsm8k
    python -m treadle.cookbook.recipes.math_rl --dataset path/to/gsm8k_train.jsonl \\
        --test_dataset path/to/gsm8k_test.jsonl

K samples per question (`group_size`), group-relative advantages, loss `ppo` by default.
The server is TREADLE_BASE_URL (or `--base_url`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from treadle.cookbook.config_cli import parse_config
from treadle.cookbook.math_env import (
    MathDataset,
    Prompter,
    arithmetic_problems,
    load_gsm8k,
)
from treadle.cookbook.rl import RLConfig, train_rl


@dataclass
class Config:
    model: str
    run_dir: str = "runs/math_rl"
    base_url: str | None = None
    dataset: str = "arithmetic"  # arithmetic | openai/gsm8k | a .jsonl/.parquet path
    test_dataset: str | None = None  # for local paths; `datasets` sources use their test split
    n_test: int = 200
    prompt_format: str = "chat"  # chat | raw
    strict: bool = True  # arithmetic only: every equation of the working must hold
    format_penalty: float = 0.0
    batch_size: int = 16  # questions per step
    group_size: int = 8
    max_tokens: int = 96
    temperature: float = 1.0
    loss_fn: str = "ppo"
    normalize_std: bool = True
    learning_rate: float = 1e-4
    lora_rank: int = 32
    lora_alpha: float | None = None
    max_steps: int = 50
    eval_every: int = 10
    eval_samples: int = 4
    save_every: int = 10
    seed: int = 0
    load_checkpoint_path: str | None = None  # e.g. an SFT run's state
    load_optimizer: bool = False  # also carry on its Adam moments
    mlflow_uri: str | None = None
    wandb_project: str | None = None  # log to Weights & Biases too (tinker-cookbook's names)
    wandb_name: str | None = None


def make_dataset_fn(cfg: Config):
    def make(tokenizer) -> MathDataset:
        if cfg.dataset == "arithmetic":
            train = arithmetic_problems(5000, seed=cfg.seed + 1)
            test = arithmetic_problems(cfg.n_test, seed=10_000)
            strict = cfg.strict
        else:
            train = load_gsm8k(cfg.dataset, "train")
            test = load_gsm8k(cfg.test_dataset or cfg.dataset, "test")[: cfg.n_test]
            strict = False
        prompter = Prompter(tokenizer, cfg.prompt_format)
        return MathDataset(
            train, test, prompter, cfg.batch_size, strict, cfg.seed, cfg.format_penalty
        )

    return make


def rl_config(cfg: Config) -> RLConfig:
    shared = {k: v for k, v in asdict(cfg).items() if k in RLConfig.__dataclass_fields__}
    return RLConfig(**shared, extra={k: v for k, v in asdict(cfg).items() if k not in shared})


def plan_run(cfg: Config, svc):
    """The run's tokens, before it runs (treadle estimate): its prompts, completions of up
    to max_tokens, its evaluations."""
    from treadle.cookbook.estimate import rl_run_plan

    dataset = make_dataset_fn(cfg)(svc.get_tokenizer(cfg.model))
    return rl_run_plan(rl_config(cfg), dataset)


def main(cfg: Config):
    from treadle import ServiceClient

    with ServiceClient(base_url=cfg.base_url) as svc:
        return train_rl(rl_config(cfg), make_dataset_fn(cfg), service=svc)


if __name__ == "__main__":
    main(parse_config(Config, description=__doc__))
