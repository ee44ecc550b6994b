"""The frozen base model sharded across a group with FSDP2 (`--shard fsdp`).

`fully_shard` (torch.distributed.fsdp) is applied to every decoder layer (the classes the
model lists as `_no_split_modules`), then to the root: each rank keeps 1/world of every
weight, and a layer's weights are all-gathered just before its forward (and again before
its backward), then freed. A model larger than one device's memory fits on several.

Treadle's LoRA (treadle.engine.lora) is an instance-level forward on each targeted
nn.Linear, inside those layers: it reads `module.weight` when called, which FSDP has
unsharded by then, and adds each row's `B(A(x))`. The adapters themselves are small and
stay whole on every rank (replicated, summed gradients: treadle.engine.train). The
merged-weight path of a single adapter (W + s B A in one matmul) is turned off, and a
merged export loads a whole copy of the base on the CPU of rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from treadle.engine import checkpoints
from treadle.engine.models import load_base_model


def shard_base(engine: Any, group: Any) -> None:
    """Shard engine.model in place across the group (every rank at once: collectives)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = engine.model
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in kinds]
    if not blocks:
        raise ValueError(
            f"--shard fsdp: {type(model).__name__} names no decoder layer class "
            f"(_no_split_modules is {sorted(kinds)})"
        )
    mesh = init_device_mesh(group.device.type, (group.world,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the rest: embeddings, final norm, head
    engine.bank.merge_when_cheaper = False  # the merged path reads whole weights itself
    engine.device = engine.base.device = group.device
    # FSDP allocates each layer's unsharded weights at its first all-gather; under the
    # sampler's inference_mode they would be inference tensors that training cannot use
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=group.device), use_cache=False)


def save_merged(engine: Any, adapter_or_snapshot_id: str, out_dir: str | Path) -> None:
    """Rank 0: a merged HF folder from a whole copy of the base loaded on the CPU."""
    dtype = str(engine.dtype).removeprefix("torch.")
    base = load_base_model(engine.model_dir, dtype=dtype, device="cpu")
    adapter = engine.bank.get(adapter_or_snapshot_id)
    checkpoints.save_merged(base.model, adapter, out_dir, engine.model_dir)
