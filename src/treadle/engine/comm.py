"""The ranks an engine call runs on: one process (`ONE_RANK`) or a torch.distributed group.

A call that splits its work across ranks (treadle.engine.train, treadle.engine.dist_decode)
takes a communicator and is written once: a single process is the group of one, whose
collectives are trivial (a sum over one rank is the value itself, a gather is a list of one,
a failure is raised as it is). `GroupComm` does them over a group (treadle.engine.
distributed): Python values and decisions over its gloo "control" group, tensors that stay on
the device (gradients) over the default group, whose backend follows the device.

A collective that fails (a rank died, the group is stuck) ends the group: `broken`.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from treadle.engine.device_faults import is_device_fault
from treadle.errors import TreadleError

log = logging.getLogger("treadle.distributed")


class OneRank:
    """The group of one process: every collective is the identity."""

    rank, world, fsdp, leader = 0, 1, False, True

    def sum_values(self, values: list[float], failed: bool) -> tuple[list[float], bool]:
        return values, failed

    def sum_tensors(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return tensors

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def vote(self, value: int) -> int:
        return value

    def raise_failures(self, failure: BaseException | None) -> None:
        if failure is not None:
            raise failure


ONE_RANK = OneRank()


class GroupBroken(RuntimeError):
    """The group cannot act as one engine any more: raised once on_broken returns (it
    ends the process unless a test gave its own)."""


class GroupFailure(RuntimeError):
    """A call failed on some rank (every rank raises it; the group is still whole)."""


class GroupComm:
    """The collectives of one rank of a group (`group`: treadle.engine.distributed.Group);
    `device` is the rank's engine device, where a failure is checked for a device fault."""

    def __init__(self, group: Any, device: Any, on_broken: Callable[[str], None]):
        self.group = group
        self.rank, self.world = group.rank, group.world
        self.fsdp, self.leader = group.fsdp, group.leader
        self.device = device
        self._on_broken = on_broken

    # ---- calls from rank 0 ----
    def tell(self, name: str, args: tuple) -> None:
        """Rank 0: what every other rank runs next (they wait in `receive`)."""
        assert self.leader
        if self.world > 1:
            self.broadcast(((name, args),))

    def receive(self) -> tuple[str, tuple]:
        return self.broadcast((None,))[0]

    def broadcast(self, objs: tuple) -> list[Any]:
        """Rank 0's objects, on every rank."""
        box = list(objs)
        self._safely(dist.broadcast_object_list, box, src=0, group=self.group.control)
        return box

    def decide(self, code: int) -> int:
        """Rank 0's code, on every rank (one small tensor: cheaper than an object)."""
        t = torch.tensor([code], dtype=torch.int64)
        self._safely(dist.broadcast, t, src=0, group=self.group.control)
        return int(t[0])

    # ---- sums and votes ----
    def vote(self, value: int) -> int:
        """The largest value any rank gives (a control-group all-reduce)."""
        t = torch.tensor([value], dtype=torch.int64)
        self._safely(dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.group.control)
        return int(t[0])

    def agree(self, name: str, code: int) -> None:
        """All ranks must have ended `name` the same way (0 ok, 1 refused, 2 failed)."""
        if self.world == 1:
            return
        t = torch.tensor([code, -code], dtype=torch.int64)
        self._safely(dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.group.control)
        if int(t[0]) != -int(t[1]):
            self.broken(f"ranks disagree on how {name} ended (codes {-int(t[1])}..{int(t[0])})")

    def sum_values(self, values: list[float], failed: bool) -> tuple[list[float], bool]:
        """Each value summed over the ranks, and whether any rank failed (one all-reduce)."""
        t = torch.tensor([*values, float(failed)], dtype=torch.float64)
        self._safely(dist.all_reduce, t, op=dist.ReduceOp.SUM, group=self.group.control)
        out = t.tolist()
        return out[:-1], out[-1] > 0

    def sum_tensors(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor summed over the ranks (one all-reduce of them all, on the device):
        new tensors, none a view of a shared buffer."""
        if not tensors:
            return []
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._safely(dist.all_reduce, flat, op=dist.ReduceOp.SUM)
        pieces = flat.split([t.numel() for t in tensors])
        return [p.view_as(t).clone() for p, t in zip(pieces, tensors, strict=True)]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's obj at rank 0 (in rank order); None elsewhere."""
        out = [None] * self.world if self.leader else None
        self._safely(dist.gather_object, obj, out, dst=0, group=self.group.control)
        return out

    # ---- failures ----
    def raise_failures(self, failure: BaseException | None) -> None:
        """Collective: if any rank failed, every rank raises (the first failure, at rank 0);
        if some rank's device is unusable after it, an AcceleratorError naming that rank."""
        fault = failure is not None and is_device_fault(failure, self.device)
        if not self.vote(2 if fault else int(failure is not None)):
            return
        failures: list[Any] = [None] * self.world
        mine = (fault, _picklable(failure))
        self._safely(dist.all_gather_object, failures, mine, group=self.group.control)
        faulted = [(rank, f) for rank, (bad, f) in enumerate(failures) if bad]
        if faulted:
            rank, f = faulted[0]
            raise torch.AcceleratorError(f"rank {rank}: {f}")
        first = next(f for _, f in failures if f is not None)
        raise first if isinstance(first, TreadleError) else GroupFailure(str(first))

    def _safely(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a rank is gone or the group is stuck
            self.broken(f"{fn.__name__} failed: {type(e).__name__}: {e}")

    def broken(self, reason: str) -> None:
        log.critical("rank %d: the worker group is broken: %s", self.rank, reason)
        self._on_broken(reason)
        raise GroupBroken(reason)  # on_broken did not end the process


def _picklable(e: BaseException | None) -> BaseException | None:
    if e is None:
        return None
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")
