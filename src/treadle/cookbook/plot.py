"""`treadle plot RUN_DIR`: one PNG per group of metrics in metrics.jsonl, plus an overview."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def load_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path, keys: list[str] | None = None) -> list[Path]:
    """Plot every numeric metric (or `keys`) against step; returns the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_metrics(run_dir)
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        for k, v in row.items():
            if k != "step" and isinstance(v, int | float) and (keys is None or k in keys):
                series[k].append((row["step"], float(v)))
    if not series:
        raise ValueError(f"no numeric metrics in {Path(run_dir) / 'metrics.jsonl'}")

    names = sorted(series)
    cols = min(3, len(names))
    nrows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.2 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        steps, values = zip(*series[name], strict=True)
        ax.plot(steps, values, marker="o" if len(steps) < 40 else None, markersize=3)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(run_dir) / "metrics.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]
