"""Which GPUs each worker group of a served model gets on this machine.

`treadle serve --device cuda --devices N --replicas R` with models M1, M2, ...: the worker
groups in order (each model's replicas in turn) take the next N GPUs each, handed to the
group through CUDA_VISIBLE_DEVICES, so that rank r's cuda:LOCAL_RANK is a GPU of its own.
With fewer GPUs than the groups need, the groups wrap around and share GPUs (several small
models on one large GPU, say), and the log says so; a group never gets one GPU twice.

    plan_gpus(config)   # {("treadle/tiny-llama", 0): ["0", "1"], ("treadle/tiny-llama", 1): ["2", "3"]}

An explicit index (--device cuda:1) is the operator's choice, as is a CPU device: nothing is
assigned then, and the workers inherit this process's environment.
"""

from __future__ import annotations

import logging
import os

from treadle.server.config import ServerConfig

log = logging.getLogger("treadle.placement")

GpuPlan = dict[tuple[str, int], list[str]]  # (model name, replica) -> its GPUs, in rank order


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: CUDA_VISIBLE_DEVICES when set (ids or UUIDs, as
    given), else every GPU torch sees."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def plan_gpus(config: ServerConfig, gpus: list[str] | None = None) -> GpuPlan:
    """The GPUs of every worker group the supervisor starts ({} when it assigns none)."""
    if config.device != "cuda":
        return {}
    gpus = visible_gpus() if gpus is None else gpus
    n = config.devices
    if n > len(gpus):
        raise ValueError(
            f"devices: {n} ranks per worker group need {n} GPUs, but {len(gpus)} "
            f"{'is' if len(gpus) == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES: "
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
    groups = [(name, r) for name in config.models for r in range(config.replicas)]
    plan = {g: [gpus[(k * n + i) % len(gpus)] for i in range(n)] for k, g in enumerate(groups)}
    if len(groups) * n > len(gpus):
        log.warning(
            "%d worker groups of %d rank(s) on %d GPU(s): groups share GPUs (%s)",
            len(groups),
            n,
            len(gpus),
            "; ".join(f"{name}#{r}: {','.join(ids)}" for (name, r), ids in plan.items()),
        )
    return plan
