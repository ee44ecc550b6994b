"""Code RL: Python solutions graded by unit tests in a sandbox, overlapped sampling and training.

    python -m treadle.cookbook.recipes.code_rl --model treadle/tiny-llama --run_dir runs/code \\
        --dataset builtin --max_steps 20
    python -m treadle.cookbook.recipes.code_rl --model Qwen/Qwen3-4B-Instruct-2507 \\
        --dataset agentica-org/DeepCoder-Preview-Dataset --dataset_subset lcbv5 \\
        --two_turn true --max_steps_off_policy 2 --stale_policy drop
    python -m treadle.cookbook.recipes.code_rl --dataset problems.jsonl \\
        --sandbox http://localhost:8080/run_code      # a SandboxFusion server

The local sandbox needs bubblewrap (`apt-get install bubblewrap`); `--unsafe_local_sandbox true`
runs solutions without it, as plain processes that can read whatever the trainer can.

Reward 1 when every test passes, 0 otherwise, `format_penalty` without a code block.
`--two_turn true` lets the model call `check_solution` once before its graded answer.
Groups are trained at most `max_steps_off_policy` steps after the policy that sampled them:
paced by admission control (`stale_policy` pace), or older ones requeued or dropped. The server is TREADLE_BASE_URL (or `--base_url`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from treadle.cookbook.code_env import (
    CodeDataset,
    CodeRenderer,
    GradeSettings,
    load_problems,
)
from treadle.cookbook.config_cli import parse_config
from treadle.cookbook.rl_overlap import OverlapConfig, train_rl_overlapped
from treadle.sandbox import FusionSandbox, LocalSandbox, SandboxLimits


@dataclass
class Config:
    model: str
    run_dir: str = "runs/code_rl"
    base_url: str | None = None
    dataset: str = "builtin"  # builtin | a .jsonl path | a `datasets` source
    dataset_subset: str | None = None  # e.g. lcbv5 for agentica-org/DeepCoder-Preview-Dataset
    test_dataset: str | None = None  # held-out problems; default: the last n_test of dataset
    n_test: int = 4
    two_turn: bool = False
    sandbox: str = "local"  # local | the URL of a SandboxFusion server
    sandbox_workers: int = 8
    # local sandbox without bubblewrap: run solutions as plain processes, NOT isolated
    unsafe_local_sandbox: bool = False
    timeout_per_test_s: float = 2.0
    memory_mb: int = 1024
    format_penalty: float = -0.1
    batch_size: int = 8  # problems per step
    group_size: int = 8
    max_tokens: int = 512
    max_context: int = 4096
    temperature: float = 1.0
    loss_fn: str = "cispo"
    max_steps_off_policy: int = 1
    stale_policy: str = "pace"  # pace | requeue | drop (rl_overlap.py)
    rollout_workers: int = 4
    stream_groups: int = 1
    normalize_std: bool = True
    remove_constant_reward_groups: bool = True
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


def make_sandbox(cfg: Config):
    if cfg.sandbox == "local":
        limits = SandboxLimits(
            timeout_s=10.0, cpu_s=10, memory_mb=cfg.memory_mb, max_output_bytes=1 << 20
        )
        return LocalSandbox(limits, workers=cfg.sandbox_workers, unsafe=cfg.unsafe_local_sandbox)
    return FusionSandbox(cfg.sandbox, workers=cfg.sandbox_workers, memory_mb=cfg.memory_mb)


def split_problems(cfg: Config):
    if cfg.test_dataset:
        return load_problems(cfg.dataset, "train", cfg.dataset_subset), load_problems(
            cfg.test_dataset, "test", cfg.dataset_subset
        )[: cfg.n_test]
    if cfg.dataset in ("builtin",) or cfg.dataset.endswith(".jsonl"):
        problems = load_problems(cfg.dataset)
        if cfg.n_test >= len(problems):
            return problems, []
        return problems[: len(problems) - cfg.n_test], problems[len(problems) - cfg.n_test :]
    train = load_problems(cfg.dataset, "train", cfg.dataset_subset)
    test = load_problems(cfg.dataset, "test", cfg.dataset_subset)[: cfg.n_test]
    return train, test


def make_dataset_fn(cfg: Config, sandbox):
    def make(tokenizer) -> CodeDataset:
        train, test = split_problems(cfg)
        settings = GradeSettings(
            sandbox, cfg.timeout_per_test_s, cfg.format_penalty, cfg.max_context, cfg.max_tokens
        )
        renderer = CodeRenderer(tokenizer, cfg.two_turn)
        return CodeDataset(train, test, renderer, settings, cfg.batch_size, cfg.seed)

    return make


def overlap_config(cfg: Config) -> OverlapConfig:
    fields = OverlapConfig.__dataclass_fields__
    shared = {k: v for k, v in asdict(cfg).items() if k in fields and k != "extra"}
    return OverlapConfig(**shared, extra={k: v for k, v in asdict(cfg).items() if k not in fields})


def main(cfg: Config, on_step=None):
    from treadle import ServiceClient

    sandbox = make_sandbox(cfg)
    try:
        with ServiceClient(base_url=cfg.base_url) as svc:
            return train_rl_overlapped(
                overlap_config(cfg), make_dataset_fn(cfg, sandbox), service=svc, on_step=on_step
            )
    finally:
        sandbox.close()


if __name__ == "__main__":
    main(parse_config(Config, description=__doc__))
