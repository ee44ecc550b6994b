"""Loading preference data for the dpo and kto recipes: local JSONL or a `datasets` name."""

from __future__ import annotations

import json
from pathlib import Path


def load_rows(source: str, limit: int) -> list[dict]:
    path = Path(source)
    if path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return rows[:limit]
    import datasets

    return list(datasets.load_dataset(source, split=f"train[:{limit}]"))
