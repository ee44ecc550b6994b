"""DPO from preference pairs, as a custom loss over the reference model's logprobs.

    python -m treadle.cookbook.recipes.dpo --model treadle/tiny-llama --dataset pairs.jsonl
Each line: {"prompt": "..." or [chat messages], "chosen": "...", "rejected": "..."}.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from treadle.cookbook.config_cli import parse_config
from treadle.cookbook.preference import PreferenceConfig, render, train_preference
from treadle.cookbook.recipes._preference_data import load_rows


@dataclass
class Config:
    model: str
    dataset: str
    run_dir: str = "runs/dpo"
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


def main(cfg: Config):
    from treadle import ServiceClient

    with ServiceClient(base_url=cfg.base_url) as svc:
        tokenizer = svc.get_tokenizer(cfg.model)
        pairs = [
            (
                render(tokenizer, r["prompt"], r["chosen"], cfg.max_length),
                render(tokenizer, r["prompt"], r["rejected"], cfg.max_length),
            )
            for r in load_rows(cfg.dataset, cfg.max_examples)
        ]
        fields = PreferenceConfig.__dataclass_fields__
        config = PreferenceConfig(**{k: v for k, v in asdict(cfg).items() if k in fields})
        return train_preference(config, "dpo", pairs, service=svc)


if __name__ == "__main__":
    main(parse_config(Config, description=__doc__))
