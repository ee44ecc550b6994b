"""SFT on chat data: loss only on the assistant's tokens, one conversation per datum, held-out
NLL.

    python -m treadle.cookbook.recipes.chat_sft --model treadle/tiny-llama \\
        --dataset chats.jsonl --max_steps 100          # lines {"messages": [...]}
    python -m treadle.cookbook.recipes.chat_sft --model Qwen/Qwen3-0.6B \\
        --dataset allenai/tulu-3-sft-mixture           # or HuggingFaceH4/ultrachat_200k
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from treadle.cookbook.config_cli import parse_config
from treadle.cookbook.sft import SFTConfig, render_chat, train_sft

# `datasets` sources and the split each keeps its conversations in.
HF_SPLITS = {
    "allenai/tulu-3-sft-mixture": ("train", None),
    "HuggingFaceH4/ultrachat_200k": ("train_sft", "test_sft"),
}


@dataclass
class Config:
    model: str
    dataset: str
    run_dir: str = "runs/chat_sft"
    base_url: str | None = None
    n_test: int = 64
    max_examples: int = 20_000
    learning_rate: float = 1e-4
    lora_rank: int = 32
    lora_alpha: float | None = None
    batch_size: int = 32
    max_length: int = 512
    max_steps: int = 100
    eval_every: int = 20
    save_every: int = 50
    seed: int = 0
    mlflow_uri: str | None = None
    wandb_project: str | None = None  # log to Weights & Biases too (tinker-cookbook's names)
    wandb_name: str | None = None


def load_conversations(source: str, limit: int) -> list[list[dict]]:
    path = Path(source)
    if path.exists():
        lines = path.read_text().splitlines()
        return [json.loads(line)["messages"] for line in lines if line.strip()][:limit]
    import datasets

    split = HF_SPLITS.get(source, ("train", None))[0]
    rows = datasets.load_dataset(source, split=f"{split}[:{limit}]")
    return [row["messages"] for row in rows]


def plan_run(cfg: Config, svc):
    """The run's tokens, before it runs (treadle estimate): its batches and evaluations."""
    from treadle.cookbook.estimate import sft_run_plan
    from treadle.cookbook.sft import training_sequences

    sft = SFTConfig(**{k: v for k, v in asdict(cfg).items() if k in SFTConfig.__dataclass_fields__})
    tokenizer = svc.get_tokenizer(cfg.model)
    conversations = load_conversations(cfg.dataset, cfg.max_examples)
    examples = [render_chat(tokenizer, m, cfg.max_length) for m in conversations]
    test, train = examples[: cfg.n_test], examples[cfg.n_test :]
    return sft_run_plan(sft, training_sequences(train, sft.max_length), test)


def main(cfg: Config):
    from treadle import ServiceClient

    with ServiceClient(base_url=cfg.base_url) as svc:
        sft = SFTConfig(
            **{k: v for k, v in asdict(cfg).items() if k in SFTConfig.__dataclass_fields__}
        )
        conversations = load_conversations(cfg.dataset, cfg.max_examples)
        tokenizer = svc.get_tokenizer(cfg.model)
        examples = [render_chat(tokenizer, m, cfg.max_length) for m in conversations]
        test, train = examples[: cfg.n_test], examples[cfg.n_test :]
        run, _ = train_sft(sft, train, test, service=svc)
        return run


if __name__ == "__main__":
    main(parse_config(Config, description=__doc__))
