"""Everything that touches tensors: the base model, LoRA adapters, losses, training, sampling.

Needs the `server` extra (torch, transformers, peft). `treadle.engine.specs` and
`treadle.engine.types` import without torch: the server's edge checks requests with them.
"""

from typing import Any

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":  # imported on first use: the torch-free modules stay torch-free
        from treadle.engine.engine import Engine

        return Engine
    raise AttributeError(name)
