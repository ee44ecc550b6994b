"""The weights an engine holds for sampling, and a model's state on disk for recovery.

"Live refs" are the engine ids a sampling session may use: snapshots of training models
(`snap:...`, kept per model, at most `max_snapshots`) and checkpoints loaded for sampling.
`is_live` is asked from any thread (the API side checks a sampler before it files a sample
op), so the set sits behind a lock; the rest runs on the engine thread.

A sample op holds its weights from its arrival until it ends (`hold`, `release`): a sampler
ref is kept, and a live training adapter is copied into a "pin" (one per adapter for as
long as its weights do not change), so that a chat on a live session answers from the
weights it was filed against even if an optim_step runs before it joins the decode batch.
A ref dropped, or a pin no op holds any more, is freed only once nothing uses it: no op
holds it and no row of the decode batch is routed to it (`_routed`: finished rows stay in
the batch until it compacts, and every decode step routes all of its rows).

State snapshots (`snapshot_state`) are what recovery loads before it replays later ops:
a model's adapter, AdamW moments, step and accumulated gradients, and its sampler
snapshots not yet on disk, in a new folder complete before it is named. The worker writes
these folders and never deletes them: the API does, once no recorded snapshot names them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import uuid
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treadle.artifacts.folders import atomic_dir
from treadle.engine.types import SampleRequest
from treadle.errors import InvalidRequestError, NotFoundError, TreadleError
from treadle.protocol.facts import StateSnapshot
from treadle.protocol.ops import Op

log = logging.getLogger("treadle.executor")


class LiveWeights:
    """Sampler weights in memory and state snapshots on disk, of one engine."""

    def __init__(
        self,
        engine: Any,
        max_snapshots: int = 8,
        state_root: Path | None = None,
        on_refs: Callable[[list[str], list[str]], None] | None = None,
    ):
        self.engine = engine
        self._on_refs = on_refs  # (added, dropped) sampler refs, for a remote API's mirror
        self.max_snapshots = max_snapshots
        self.state_root = state_root  # where state snapshots go (None: never written)
        self.snapshots: dict[str, deque[str]] = {}  # model_id → its live snapshots, oldest first
        self._persisted: dict[str, str] = {}  # sampler snapshot → its folder on disk
        self._live: set[str] = set()  # engine ids a sampling session may use
        self._live_lock = threading.Lock()
        self._holds: Counter[str] = Counter()  # refs and pins sample ops hold
        self._held: dict[str, str] = {}  # request_id → the ref or pin it holds
        self._pin_of: dict[str, str] = {}  # live adapter → its pin, while its weights stay
        self._pin_ids = itertools.count()
        self._drop_later: set[str] = set()  # dropped refs and unheld pins, freed once unused

    def keep_snapshot(self, model_id: str, snap: str) -> None:
        """A new sampler snapshot of a model: live, and the oldest beyond the limit dropped."""
        self._add_live(snap)
        kept = self.snapshots.setdefault(model_id, deque())
        kept.append(snap)
        while len(kept) > self.max_snapshots:
            self.drop_ref(kept.popleft())

    # ---- the weights sample ops hold ----
    def hold(self, ops: list[Op]) -> None:
        """Keep each sample op's weights as they are now until `release`: a sampler ref is
        held, a live training adapter pinned (copied; one pin per adapter until its weights
        change). An op holding already is left as it is; a key that is neither (no such
        adapter yet) is held at its next `hold`, or left for the sampler to refuse."""
        for op in ops:
            key = op.payload.request.adapter
            if key is None or op.request_id in self._held:
                continue
            held = key if self.is_live(key) else self._pin(key)
            if held is None:
                continue
            self._holds[held] += 1
            self._held[op.request_id] = held

    def _pin(self, adapter_id: str) -> str | None:
        pin = self._pin_of.get(adapter_id)
        if pin is None:
            pin = f"pin:{next(self._pin_ids)}"
            try:
                self.engine.snapshot(adapter_id, pin)
            except NotFoundError:
                return None
            self._pin_of[adapter_id] = pin
        return pin

    def request_of(self, op: Op) -> SampleRequest:
        """The op's engine request, routed to the weights it holds."""
        request = op.payload.request
        held = self._held.get(op.request_id)
        if held is None or held == request.adapter:
            return request
        return dataclasses.replace(request, adapter=held)

    def release(self, ops: list[Op]) -> None:
        """The ops ended: their weights are freed once nothing else uses them."""
        for op in ops:
            held = self._held.pop(op.request_id, None)
            if held is None:
                continue
            self._holds[held] -= 1
            if self._holds[held] > 0:
                continue
            del self._holds[held]
            if held.startswith("pin:"):
                self._drop_later.add(held)
                self._pin_of = {a: p for a, p in self._pin_of.items() if p != held}
        self.collect()

    def weights_changed(self, adapter_id: str) -> None:
        """The adapter's weights changed (or it is gone): ops arriving later pin anew."""
        self._pin_of.pop(adapter_id, None)

    def collect(self) -> None:
        """Free the dropped refs and pins that no op holds and no decode row uses."""
        if not self._drop_later:
            return
        routed = self._routed()
        for ref in [r for r in self._drop_later if not self._holds.get(r) and r not in routed]:
            self._drop_later.discard(ref)
            self._free(ref)

    def _routed(self) -> set[str]:
        """The refs rows of the decode batch are routed to (the executor's batch)."""
        return set()

    # ---- sampler weights in memory ----
    def is_live(self, ref: str) -> bool:
        with self._live_lock:
            return ref in self._live

    def _add_live(self, ref: str) -> None:
        with self._live_lock:
            self._live.add(ref)
        if self._on_refs is not None:
            self._on_refs([ref], [])

    def load_sampler(self, ref: str, checkpoint_type: str, directory: str) -> None:
        """A sampler from a saved checkpoint: loaded as an adapter of its own."""
        if checkpoint_type == "training":
            self.engine.load_state(ref, directory, with_optimizer=False)
        else:
            self.engine.load_adapter(ref, directory)
        self._add_live(ref)

    def check_adapter(self, directory: str) -> None:
        """Load a PEFT adapter folder under a throwaway id and free it: does it fit?"""
        probe = f"probe:{uuid.uuid4().hex}"
        try:
            self.engine.load_adapter(probe, directory)
        except TreadleError:
            raise
        except Exception as e:  # unreadable weights, a malformed config: the sender's fault
            raise InvalidRequestError(
                f"body: not a loadable PEFT adapter for this model: {type(e).__name__}: {e}"
            ) from e
        self.engine.drop_adapter(probe)

    # ---- durability: state snapshots and restoring from them ----
    def snapshot_state(self, model_id: str, seq_id: int) -> StateSnapshot:
        """Write the model's state (adapter, AdamW, step, accumulated gradients) and its
        sampler snapshots not yet on disk; the folder is new, complete before it is named."""
        assert self.state_root is not None
        root = self.state_root / _safe(model_id)
        final = root / f"state-{seq_id}-{uuid.uuid4().hex[:8]}"
        tmp = root / f".tmp-{final.name}"
        tmp.mkdir(parents=True)
        self.engine.save_snapshot(model_id, tmp)
        tmp.rename(final)
        samplers = {}
        for ref in self.snapshots.get(model_id, ()):
            if ref not in self._persisted:
                folder = root / "samplers" / _safe(ref)
                # whole before it is named: a folder of this name is one a snapshot wrote and
                # never committed (a crash between the two), replaced only by a complete one
                with atomic_dir(folder) as tmp:
                    self.engine.save_adapter(ref, tmp)
                self._persisted[ref] = str(folder)
            samplers[ref] = self._persisted[ref]
        return StateSnapshot(model_id, seq_id, str(final), samplers)

    def restore_model(self, model_id: str, state_dir: str | None, samplers: dict[str, str]) -> None:
        """A model as its last snapshot left it (or nothing yet: its create op replays),
        with the sampler snapshots it had then."""
        self.weights_changed(model_id)
        if state_dir is not None:
            self.engine.load_snapshot(model_id, state_dir)
        kept = self.snapshots.setdefault(model_id, deque())
        for ref, folder in samplers.items():
            if ref in kept:
                continue
            self.engine.load_frozen(ref, folder)
            self._persisted[ref] = folder
            self._add_live(ref)
            kept.append(ref)

    def drop_ref(self, ref: str) -> None:
        with self._live_lock:
            if ref not in self._live:
                return
            self._live.discard(ref)
        if self._on_refs is not None:
            self._on_refs([], [ref])
        # Its folder on disk stays: the last recorded state snapshot may name it, and a crash
        # before a newer one is recorded restores that one. The API deletes it once no row
        # names it (queries.record_snapshot, drop_states).
        self._persisted.pop(ref, None)
        self._drop_later.add(ref)  # a sample op may still decode with it
        self.collect()

    def _free(self, ref: str) -> None:
        try:
            if ref.startswith(("snap:", "pin:")):
                self.engine.drop_snapshot(ref)
            else:
                self.engine.drop_adapter(ref)
        except Exception:
            log.exception("could not free %s", ref)

    def drop_all_refs(self) -> None:
        with self._live_lock:
            refs = list(self._live)
        for ref in refs:
            self.drop_ref(ref)
        self.snapshots.clear()

    def drop_model(self, model_id: str) -> None:
        self.weights_changed(model_id)
        for snap in self.snapshots.pop(model_id, deque()):
            self.drop_ref(snap)
        try:
            self.engine.drop_adapter(model_id)
        except NotFoundError:
            pass  # never created (its create op had not run)
        except Exception:
            log.exception("could not drop adapter %s", model_id)


def _safe(name: str) -> str:
    """An engine id as one folder name (ids hold ':')."""
    return name.replace("/", "_").replace(":", "_")
