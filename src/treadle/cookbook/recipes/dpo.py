"""DPO from preference pairs, as a custom loss over the reference model's logprobs.

    python -m treadle.cookbook.recipes.dpo --model treadle/tiny-llama --dataset pairs.jsonl
Each line: {"prompt": "..." or [chat messages], "chosen": "...", "rejected": "..."}.
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle.cookbook.config_cli import parse_config
from treadle.cookbook.preference import render
from treadle.cookbook.recipes._preference import PreferenceRecipeConfig, run


@dataclass
class Config(PreferenceRecipeConfig):
    run_dir: str = "runs/dpo"


def to_pair(tokenizer, row: dict, max_length: int):
    return (
        render(tokenizer, row["prompt"], row["chosen"], max_length),
        render(tokenizer, row["prompt"], row["rejected"], max_length),
    )


def main(cfg: Config):
    return run(cfg, "dpo", to_pair)


if __name__ == "__main__":
    main(parse_config(Config, description=__doc__))
