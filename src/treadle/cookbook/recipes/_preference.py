"""What the dpo and kto recipes share: their flags, data loading and the run itself."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from treadle.cookbook.preference import PreferenceConfig, train_preference


@dataclass
class PreferenceRecipeConfig:
    model: str
    dataset: str
    run_dir: str = "runs/preference"
    base_url: str | None = None
    beta: float = 0.1
    learning_rate: float = 1e-5
    lora_rank: int = 32
    lora_alpha: float | None = None
    batch_size: int = 16
    max_length: int = 512
    max_examples: int = 10_000
    max_steps: int = 50
    save_every: int = 25
    seed: int = 0
    mlflow_uri: str | None = None
    wandb_project: str | None = None  # log to Weights & Biases too (tinker-cookbook's names)
    wandb_name: str | None = None


def load_rows(source: str, limit: int) -> list[dict]:
    """Local JSONL, or a `datasets` name with the same columns."""
    path = Path(source)
    if path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return rows[:limit]
    import datasets

    return list(datasets.load_dataset(source, split=f"train[:{limit}]"))


def run(cfg: PreferenceRecipeConfig, loss: str, to_example: Callable[[object, dict, int], object]):
    """`to_example(tokenizer, row, max_length)` renders a data row for `train_preference`."""
    from treadle import ServiceClient

    fields = PreferenceConfig.__dataclass_fields__
    config = PreferenceConfig(**{k: v for k, v in asdict(cfg).items() if k in fields})
    with ServiceClient(base_url=cfg.base_url) as svc:
        tokenizer = svc.get_tokenizer(cfg.model)
        examples = [
            to_example(tokenizer, r, cfg.max_length)
            for r in load_rows(cfg.dataset, cfg.max_examples)
        ]
        return train_preference(config, loss, examples, service=svc)
