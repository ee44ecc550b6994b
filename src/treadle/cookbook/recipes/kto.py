"""KTO from binary desirable/undesirable feedback, as a custom loss over reference logprobs.

    python -m treadle.cookbook.recipes.kto --model treadle/tiny-llama --dataset feedback.jsonl
Each line: {"prompt": "..." or [chat messages], "completion": "...", "label": true|false}.
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle.cookbook.config_cli import parse_config
from treadle.cookbook.preference import render
from treadle.cookbook.recipes._preference import PreferenceRecipeConfig, run


@dataclass
class Config(PreferenceRecipeConfig):
    run_dir: str = "runs/kto"
    desirable_weight: float = 1.0  # λ_D
    undesirable_weight: float = 1.0  # λ_U


def to_example(tokenizer, row: dict, max_length: int):
    return render(tokenizer, row["prompt"], row["completion"], max_length), bool(row["label"])


def main(cfg: Config):
    return run(cfg, "kto", to_example)


if __name__ == "__main__":
    main(parse_config(Config, description=__doc__))
