"""One engine over the ranks of a torch.distributed group, driven by rank 0.

    torchrun --nproc-per-node 2 -m treadle.cli worker --model m=/models/m --connect tcp://api:5555

Every rank loads the base model into its own Engine (with `shard="fsdp"` the frozen base is
then sharded across the ranks, treadle.engine.fsdp). Rank 0's DistributedEngine is what the
worker's OpExecutor calls: it has the Engine's methods, and it tells every call to the other
ranks before it runs it (the call's name and arguments, broadcast over the group's gloo
"control" group), so that all ranks run the same engine calls in the same order. The other
ranks sit in `follow()`, running what they are told on their own Engine. All ranks hold
the same adapters, snapshots and optimizer states; nothing but rank 0 reads or writes a
file, and nothing but rank 0 decides anything.

What each call does across the group:
- forward_backward: each rank takes a contiguous share of the rows (treadle.engine.train,
  the path of one process too, which is the group of one), LoRA gradients are summed
  across ranks, outputs gathered to rank 0: the result is that of one process on the
  whole batch;
- decode_batch: the continuous decode batch the worker keeps between rounds, each rank
  decoding a share of its rows, every rank stepping together (treadle.engine.dist_decode);
- sample: whole generations, each rank taking a share of the requests
  (treadle.engine.dist_sample);
- create / drop / snapshot / optim_step: every rank does the same on the same numbers, then
  the ranks check that they agree on whether it succeeded;
- load_*: rank 0 reads and checks the folder, then sends its files to the other ranks, which
  load the same bytes (no rank but 0 needs the path: other machines need no shared disk);
- save_*: rank 0 alone (every rank holds the same adapter).

A group that can no longer act as one engine (a collective failed because a rank died, or
the ranks disagree on the outcome of a call) is ended: the process exits at once with
GROUP_BROKEN, torchrun ends the other ranks, and whoever started it starts a new group,
which the API restores as it restores one restarted worker process. An outcome is never
reported from a broken group. A rank whose device a call left unusable
(treadle.engine.device_faults) makes every rank raise AcceleratorError for it, so that rank
0's worker reports the fault and the ops it hit (treadle.protocol.faults) and exits.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from treadle.engine.comm import GroupBroken, GroupComm, GroupFailure
from treadle.engine.engine import Engine
from treadle.engine.types import (
    AdamSpec,
    LoraSpec,
    SampleRequest,
    SampleResult,
    TrainBatch,
    TrainResult,
)
from treadle.errors import TreadleError

if TYPE_CHECKING:
    from treadle.engine.dist_decode import GroupDecodeBatch, RankShare

__all__ = ["DistributedEngine", "Group", "GroupBroken", "GroupFailure", "init_group"]

log = logging.getLogger("treadle.distributed")

GROUP_BROKEN = 75  # exit status of a rank whose group fell apart
# Ranks wait for rank 0's next call for as long as the server is idle: no timeout that an
# idle night would reach. A dead rank is noticed at once anyway (its sockets close).
CONTROL_TIMEOUT = timedelta(days=30)
SHARD_MODES = ("none", "fsdp")


@dataclass
class Group:
    """This process's place in its torch.distributed group.

    `control` is a gloo group for calls and Python objects (CPU); tensors that stay on the
    device (gradients, FSDP's all-gathers) use the default group, whose backend follows the
    device: NCCL on GPUs, gloo on CPU.
    """

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    control: Any
    shard: str = "none"

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def fsdp(self) -> bool:
        return self.shard == "fsdp"


def init_group(device: str = "cpu", shard: str = "none", timeout_s: float = 600.0) -> Group:
    """Join the group that torchrun describes in the environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Rank r of a machine uses cuda:LOCAL_RANK when
    `device` is a GPU."""
    if shard not in SHARD_MODES:
        raise ValueError(f"shard must be one of {SHARD_MODES}, got {shard!r}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        dev, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(dev)
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Group(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend, control, shard)


class DistributedEngine:
    """The Engine interface over a group: rank 0 calls it, the other ranks follow()."""

    def __init__(
        self,
        engine: Engine,
        group: Group,
        on_broken: Callable[[str], None] | None = None,
    ):
        self.engine = engine
        self.group = group
        self.comm = GroupComm(group, engine.device, on_broken or _exit_broken)
        self._lock = threading.Lock()  # one call at a time on the control group
        self._share: RankShare | None = None  # this rank's rows of the decode batch
        if group.fsdp:
            from treadle.engine.fsdp import shard_base

            shard_base(engine, group)

    # ---- what the server reads (EngineFacts, the worker's HELLO) ----
    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    @property
    def max_lora_rank(self) -> int:
        return self.engine.max_lora_rank

    @property
    def max_train_tokens(self) -> int:
        return self.engine.max_train_tokens

    @property
    def arch(self) -> str | None:
        return self.engine.arch

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def placement(self) -> str:
        """What the console shows: e.g. `cuda x4 (nccl, fsdp)`."""
        how = "fsdp" if self.group.fsdp else "data parallel"
        return f"{self.group.device.type} x{self.group.world} ({self.group.backend}, {how})"

    # ---- adapters: every rank the same ----
    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        self._everywhere("create_adapter", adapter_id, spec)

    def drop_adapter(self, adapter_id: str) -> None:
        self._everywhere("drop_adapter", adapter_id)

    def snapshot(self, adapter_id: str, snapshot_id: str) -> None:
        self._everywhere("snapshot", adapter_id, snapshot_id)

    def drop_snapshot(self, snapshot_id: str) -> None:
        self._everywhere("drop_snapshot", snapshot_id)

    def optim_step(self, adapter_id: str, spec: AdamSpec) -> dict[str, float]:
        # the same summed gradients and AdamW state on every rank: the same new adapter
        return self._everywhere("optim_step", adapter_id, spec)

    def adapter_step(self, adapter_id: str) -> int:
        return self.engine.adapter_step(adapter_id)

    # ---- the work split across ranks ----
    def forward_backward(
        self, batches: list[TrainBatch], forward_only: bool = False
    ) -> list[TrainResult]:
        with self._lock:
            self._tell("forward_backward", (batches, forward_only))
            return self._forward_backward(batches, forward_only)

    def sample(self, requests: list[SampleRequest]) -> list[SampleResult]:
        with self._lock:
            self._tell("sample", (requests,))
            return self._sample(requests)

    def decode_batch(self) -> GroupDecodeBatch:
        """An empty decode batch over the group (the DecodeBatch interface; a new one
        replaces the last on every rank)."""
        from treadle.engine.dist_decode import GroupDecodeBatch

        with self._lock:
            self._tell("decode_new", ())
            return GroupDecodeBatch(self, self._decode_new())

    # ---- checkpoints: rank 0 reads and writes, the others get the bytes ----
    def save_adapter(self, adapter_or_snapshot_id: str, out_dir: str | Path) -> None:
        self.engine.save_adapter(adapter_or_snapshot_id, out_dir)

    def save_state(self, adapter_id: str, out_dir: str | Path) -> None:
        self.engine.save_state(adapter_id, out_dir)

    def save_snapshot(self, adapter_id: str, out_dir: str | Path) -> None:
        self.engine.save_snapshot(adapter_id, out_dir)

    def save_merged(self, adapter_or_snapshot_id: str, out_dir: str | Path) -> None:
        if not self.group.fsdp:
            self.engine.save_merged(adapter_or_snapshot_id, out_dir)
            return
        from treadle.engine.fsdp import save_merged

        save_merged(self.engine, adapter_or_snapshot_id, out_dir)

    def load_adapter(self, adapter_id: str, in_dir: str | Path) -> None:
        self._load("load_adapter", adapter_id, in_dir)

    def load_state(self, adapter_id: str, in_dir: str | Path, with_optimizer: bool = True) -> None:
        self._load("load_state", adapter_id, in_dir, with_optimizer=with_optimizer)

    def load_snapshot(self, adapter_id: str, in_dir: str | Path) -> None:
        self._load("load_snapshot", adapter_id, in_dir)

    def load_frozen(self, snapshot_id: str, in_dir: str | Path) -> None:
        self._load("load_frozen", snapshot_id, in_dir)

    # ---- the group's life ----
    def follow(self) -> None:
        """Ranks other than 0: run what rank 0 tells, until it says stop (or is gone)."""
        assert not self.group.leader
        handlers: dict[str, Callable[..., Any]] = {
            "everywhere": self._run_everywhere,
            "forward_backward": self._forward_backward,
            "sample": self._sample,
            "load": self._run_load,
            "decode_new": self._decode_new,
            "decode_add": self._decode_add,
            "decode_step": self._decode_step,
            "decode_drop": self._decode_drop,
        }
        while True:
            name, args = self._receive()
            if name == "stop":
                return
            try:
                handlers[name](*args)
            except GroupBroken:
                raise
            except Exception as e:  # noqa: BLE001 - the ranks agreed on it: rank 0 reports it
                log.debug("rank %d: %s failed as on every rank: %s", self.group.rank, name, e)

    def release(self) -> None:
        """Rank 0: let the other ranks return from follow()."""
        with self._lock:
            self._tell("stop", ())

    # ---- internals ----
    def _everywhere(self, name: str, *args: Any) -> Any:
        with self._lock:
            self._tell("everywhere", (name, args))
            return self._run_everywhere(name, args)

    def _run_everywhere(self, name: str, args: tuple) -> Any:
        """Every rank runs engine.<name>(*args); the ranks must agree on whether it failed."""
        value, error = None, None
        try:
            value = getattr(self.engine, name)(*args)
        except Exception as e:  # noqa: BLE001 - re-raised below once the ranks agree
            error = e
        self._agree(name, 0 if error is None else 1 if isinstance(error, TreadleError) else 2)
        if error is not None:
            raise error
        return value

    def _load(self, name: str, key: str, in_dir: str | Path, **kwargs: Any) -> None:
        with self._lock:
            getattr(self.engine, name)(key, in_dir, **kwargs)  # rank 0 checks the files first
            files = _read_folder(Path(in_dir))
            self._tell("load", (name, key, files, kwargs))
            self._agree(name, 0)

    def _run_load(self, name: str, key: str, files: dict[str, bytes], kwargs: dict) -> None:
        folder = Path(tempfile.mkdtemp(prefix="treadle-load-"))
        code = 0
        try:
            for rel, data in files.items():
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                (folder / rel).write_bytes(data)
            getattr(self.engine, name)(key, folder, **kwargs)
        except Exception:
            log.exception("rank %d could not load what rank 0 loaded", self.group.rank)
            code = 2
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._agree(name, code)

    def _forward_backward(self, batches: list[TrainBatch], forward_only: bool) -> list[TrainResult]:
        from treadle.engine import train

        return self._collective(
            train.forward_backward, self.engine, self.comm, batches, forward_only
        )

    def _sample(self, requests: list[SampleRequest]) -> list[SampleResult]:
        from treadle.engine import dist_sample

        return self._collective(dist_sample.sample, self.engine, self.comm, requests)

    # ---- the decode batch: this rank's share (rank 0's GroupDecodeBatch calls these) ----
    def _decode_new(self) -> RankShare:
        from treadle.engine.dist_decode import RankShare

        self._share = RankShare(self.engine, self.comm)
        return self._share

    def _decode_add(self, *args: Any) -> None:
        self._decode("add", *args)

    def _decode_step(self, *args: Any) -> None:
        self._decode("run_steps", *args)

    def _decode_drop(self, *args: Any) -> None:
        self._decode("drop", *args)

    def _decode(self, name: str, *args: Any) -> None:
        share = self._share
        if share is None:  # rank 0 never steps a batch whose step failed (nor adds to it)
            self.broken(f"decode {name} on rank {self.group.rank}, which holds no decode batch")
        try:
            self._collective(getattr(share, name), *args)
        except Exception:
            if name == "run_steps":
                self._share = None  # a failed step leaves a decode batch unusable
            raise

    def _collective(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a call that every rank takes part in. Its request errors and the failures
        it gathers are raised on every rank alike; anything else may have left the ranks
        apart, so it ends the group."""
        try:
            return fn(*args)
        except (TreadleError, GroupFailure, GroupBroken, torch.AcceleratorError):
            raise  # the same on every rank (see raise_failures)
        except Exception as e:  # noqa: BLE001
            self.broken(f"{fn.__module__}.{fn.__name__}: {type(e).__name__}: {e}")

    # ---- collectives (treadle.engine.comm; a failure of any of them ends the group) ----
    def _tell(self, name: str, args: tuple) -> None:
        self.comm.tell(name, args)

    def _receive(self) -> tuple[str, tuple]:
        return self.comm.receive()

    def _agree(self, name: str, code: int) -> None:
        self.comm.agree(name, code)

    def broken(self, reason: str) -> None:
        self.comm.broken(reason)


def _exit_broken(reason: str) -> None:
    logging.shutdown()
    os._exit(GROUP_BROKEN)


def _read_folder(folder: Path) -> dict[str, bytes]:
    """Every file under folder (an adapter or state folder: small), by relative path."""
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }
