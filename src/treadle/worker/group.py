"""A worker group: one served model on the ranks of a torchrun job.

    torchrun --nproc-per-node 4 -m treadle.cli worker --model m=/models/m \
        --connect tcp://api-host:5555 --device cuda --shard fsdp
    treadle serve --model m=/models/m --devices 4 --shard fsdp    # starts that itself

`treadle worker` becomes a group when torchrun runs it with WORLD_SIZE > 1. Every rank loads
the model (treadle.engine.distributed); rank 0 is the worker the API knows (treadle.worker.
process.Worker, with rank 0's DistributedEngine as its engine), the other ranks run what
rank 0 tells them until it says stop.

How a group ends:
- SIGTERM (from torchrun, on behalf of whoever stopped it): rank 0 drains as one worker
  does (runs what was acknowledged, writes every model's state), then releases the other
  ranks; they ignore SIGTERM and wait for that;
- a rank dies (kill -9, a crash, a lost machine): the collective the others were in, or
  their next one, fails, and they exit at once with GROUP_BROKEN without reporting any
  outcome; torchrun ends whatever rank is left and exits; the supervisor (or the operator's
  own restart policy) starts a new group, which the API restores like one worker process
  (a rank that crashed left its crash log, by which the supervisor blames the ops rank 0
  was running: treadle.protocol.flight_recorder);
- torchrun itself is killed: every rank dies with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import os
import signal

from treadle.protocol.worker_config import WorkerConfig

log = logging.getLogger("treadle.worker.group")


def in_group() -> bool:
    """Whether this process is one rank of a torchrun job of several processes."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def run_group(config: WorkerConfig, address: str, token: str, replica: int = -1) -> None:
    """`treadle worker` as one rank of a worker group."""
    import torch.distributed as dist

    from treadle.engine.distributed import DistributedEngine, init_group
    from treadle.worker.process import Worker, load_engine, model_loading

    _die_with_parent()
    group = init_group(config.device, config.shard)
    # FSDP: the whole base is read into host memory first, then sharded onto the devices
    with model_loading(config):
        engine = load_engine(config, device="cpu" if group.fsdp else str(group.device))
    dist_engine = DistributedEngine(engine, group)
    log.info("rank %d of %d: %s on %s", group.rank, group.world, config.name, dist_engine.placement)
    if group.leader:
        worker = Worker(config, address, token, replica, engine=dist_engine)
        signal.signal(signal.SIGTERM, lambda *_: worker.drain_and_exit())
        worker.run()
        dist_engine.release()
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 says when the group ends
        dist_engine.follow()
    dist.destroy_process_group()


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent was gone before the line above
        os._exit(1)
