"""The weights an engine holds for sampling, and a model's state on disk for recovery.

"Live refs" are the engine ids a sampling session may use: snapshots of training models
(`snap:...`, kept per model, at most `max_snapshots`) and checkpoints loaded for sampling.
`is_live` is asked from any thread (the API side checks a sampler before it files a sample
op), so the set sits behind a lock; the rest runs on the engine thread.

A ref dropped while a sample op still decodes with it is freed only when that op ends
(`_holds`, `_drop_later`: the executor's decode batch keeps them up to date).

State snapshots (`snapshot_state`) are what recovery loads before it replays later ops:
a model's adapter, AdamW moments, step and accumulated gradients, and its sampler
snapshots not yet on disk, in a new folder complete before it is named.
"""

from __future__ import annotations

import logging
import shutil
import threading
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treadle.errors import InvalidRequestError, NotFoundError, TreadleError

log = logging.getLogger("treadle.executor")


@dataclass
class StateSnapshot:
    """A model's state on disk after op `seq_id`, and the sampler snapshots of it then in
    memory (engine id → folder): what recovery loads before replaying later ops."""

    model_id: str
    seq_id: int
    dir: str
    samplers: dict[str, str] = field(default_factory=dict)


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
        self._holds: Counter[str] = Counter()  # refs and pins in-flight sample ops use
        self._drop_later: set[str] = set()  # refs dropped while still in use

    def keep_snapshot(self, model_id: str, snap: str) -> None:
        """A new sampler snapshot of a model: live, and the oldest beyond the limit dropped."""
        self._add_live(snap)
        kept = self.snapshots.setdefault(model_id, deque())
        kept.append(snap)
        while len(kept) > self.max_snapshots:
            self.drop_ref(kept.popleft())

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
                shutil.rmtree(folder, ignore_errors=True)
                self.engine.save_adapter(ref, folder)
                self._persisted[ref] = str(folder)
            samplers[ref] = self._persisted[ref]
        return StateSnapshot(model_id, seq_id, str(final), samplers)

    def restore_model(self, model_id: str, state_dir: str | None, samplers: dict[str, str]) -> None:
        """A model as its last snapshot left it (or nothing yet: its create op replays),
        with the sampler snapshots it had then."""
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
        folder = self._persisted.pop(ref, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        if self._holds.get(ref):  # a sample op still decodes with it: freed when it ends
            self._drop_later.add(ref)
            return
        self._free(ref)

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
