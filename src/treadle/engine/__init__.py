"""Everything that touches tensors: the base model, LoRA adapters, losses, training, sampling.

Needs the `server` extra (torch, transformers, peft).
"""

from treadle.engine.engine import Engine

__all__ = ["Engine"]
