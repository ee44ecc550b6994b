"""KTO from binary desirable/undesirable feedback, as a custom loss over reference logprobs.

    python -m treadle.cookbook.recipes.kto --model treadle/tiny-llama --dataset feedback.jsonl
Each line: {"prompt": "..." or [chat messages], "completion": "...", "label": true|false}.
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
    run_dir: str = "runs/kto"
    base_url: str | None = None
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
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
        examples = [
            (render(tokenizer, r["prompt"], r["completion"], cfg.max_length), bool(r["label"]))
            for r in load_rows(cfg.dataset, cfg.max_examples)
        ]
        fields = PreferenceConfig.__dataclass_fields__
        config = PreferenceConfig(**{k: v for k, v in asdict(cfg).items() if k in fields})
        return train_preference(config, "kto", examples, service=svc)


if __name__ == "__main__":
    main(parse_config(Config, description=__doc__))
