"""Paced rollouts for the overlapped RL loop: staleness bounded by admission control, not by
throwing work away.

Discarding or requeueing groups that come back too stale (rl_overlap's `requeue` / `drop`)
starves slow rollouts: a long answer is the one that misses its window, so the groups that
get trained lean towards short, easy problems, and the engine time of every discarded group
is lost. Pacing (tinker-cookbook PR #822's rule) keeps every group and bounds staleness
before sampling instead:

- admission: at most (k + 1) batches of groups are started and not yet trained (k =
  `max_steps_off_policy`), and no new group starts while a group of an older version is
  still sampling and due (it must be trained at the current step, `step - version >= k`):
  the engine's capacity goes to the straggler rather than to new work;
- order: the trainer takes the oldest finished group first (policy version, then data
  order), waits for a due group rather than step past it, and trains every due group in
  the step (a step may then hold more than batch_size groups).

So every group is trained at most `max_steps_off_policy` steps after the policy that sampled
it, and none is discarded. Rollouts still in flight when the run ends are cancelled
(APIFuture.cancel: the server's cancel_future), so they stop using the engine at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from treadle import SamplingParams
from treadle.cookbook.rl import rollout_groups
from treadle.cookbook.rl_types import EnvGroupBuilder, RLDataset, Trajectory


@dataclass
class PacedItem:
    data_step: int
    index: int
    builder: EnvGroupBuilder
    version: int = -1  # the policy version it was sampled with (set when it starts)
    futures: list = field(default_factory=list)  # its sample requests, to cancel them

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.version, self.data_step, self.index)


@dataclass
class PacedResult:
    item: PacedItem
    version: int
    trajectories: list[Trajectory]
    sample_s: float
    grade_s: float


class _Tracked:
    """A sampling client whose sample futures are kept on the item (to cancel them)."""

    def __init__(self, client: Any, item: PacedItem):
        self._client, self._item = client, item

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        future = self._client.sample(*args, **kwargs)
        self._item.futures.append(future)
        return future

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class PacedPool:
    """Rollout workers under admission control; `next_for(step)` hands the trainer the
    oldest finished group it may train at `step`."""

    def __init__(self, dataset: RLDataset, config: Any, params: SamplingParams, grade_pool):
        self.dataset, self.config, self.params = dataset, config, params
        self.k, self.batch = config.max_steps_off_policy, config.batch_size
        self.grade_pool = grade_pool
        self._cond = threading.Condition()
        self._pending: collections.deque[PacedItem] = collections.deque()
        self._in_flight: dict[int, PacedItem] = {}
        self._finished: list[PacedResult] = []
        self._errors: list[BaseException] = []
        self._started: collections.Counter = collections.Counter()  # per policy version
        self._next_data_step = 0
        self._client: Any = None
        self._version = 0
        self._stop = False
        self.sampled_tokens = 0  # every finished group's, trained or not
        self.cancelled = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"paced-{i}", daemon=True)
            for i in range(config.rollout_workers)
        ]

    def start(self, client: Any, version: int, first_data_step: int) -> None:
        self._client, self._version = client, version
        self._next_data_step = first_data_step
        for t in self._threads:
            t.start()

    def publish(self, client: Any, version: int) -> None:
        with self._cond:
            self._client, self._version = client, version
            self._cond.notify_all()

    # ---- admission ----
    def _due(self, item: PacedItem, step: int) -> bool:
        return step - item.version >= self.k

    def _may_start(self) -> bool:
        """At most k + 1 batches started and not trained, and nothing new while an older
        version's group is still sampling and due now. On-policy (k = 0), one batch per
        version: a group started between a step's training and the publication of its new
        policy would be trained a step after the policy that sampled it."""
        if self.k == 0 and self._started[self._version] >= self.batch:
            return False
        if len(self._in_flight) + len(self._finished) >= (self.k + 1) * self.batch:
            return False
        return not any(
            it.version < self._version and self._due(it, self._version)
            for it in self._in_flight.values()
        )

    def _next_item(self) -> PacedItem:
        if not self._pending:
            d = self._next_data_step
            self._pending.extend(
                PacedItem(d, i, b) for i, b in enumerate(self.dataset.get_batch(d))
            )
            self._next_data_step += 1
        return self._pending.popleft()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._may_start():
                    self._cond.wait()
                if self._stop:
                    return
                item = self._next_item()
                item.version, client = self._version, self._client
                self._started[item.version] += 1
                self._in_flight[id(item)] = item
            try:
                start = time.monotonic()
                groups = rollout_groups(
                    _Tracked(client, item),
                    [item.builder],
                    self.config.group_size,
                    self.params,
                    self.grade_pool,
                )
                wall = time.monotonic() - start
                trajectories = groups[0]
                grade_s = max((t.metrics.get("grade_s", 0.0) for t in trajectories), default=0.0)
                result = PacedResult(item, item.version, trajectories, wall - grade_s, grade_s)
                tokens = sum(len(tr.action) for t in trajectories for tr in t.transitions)
                with self._cond:
                    self.sampled_tokens += tokens
                    self._finished.append(result)
            except concurrent.futures.CancelledError:
                with self._cond:
                    self.cancelled += 1
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it
                with self._cond:
                    self._errors.append(exc)
            finally:
                with self._cond:
                    self._in_flight.pop(id(item), None)
                    self._cond.notify_all()

    # ---- the trainer's side ----
    def next_for(self, step: int, timeout: float = 0.1) -> PacedResult | None:
        """The oldest finished group, unless a group due at `step` is still sampling (then
        only a finished due group, or None after `timeout` to let the caller poll)."""
        with self._cond:
            deadline = time.monotonic() + timeout
            while True:
                if self._errors:
                    raise self._errors.pop(0)
                waiting_due = any(self._due(it, step) for it in self._in_flight.values())
                ready = sorted(
                    (r for r in self._finished if not waiting_due or self._due(r.item, step)),
                    key=lambda r: r.item.order,
                )
                if ready:
                    self._finished = [r for r in self._finished if r is not ready[0]]
                    self._cond.notify_all()
                    lag = step - ready[0].version
                    assert lag <= self.k, f"a group {lag} steps off-policy (bound {self.k})"
                    return ready[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def has_due(self, step: int) -> bool:
        """Whether a group that must be trained at `step` is still untrained."""
        with self._cond:
            groups = [*self._in_flight.values(), *(r.item for r in self._finished)]
            return any(self._due(it, step) for it in groups)

    def stop(self, timeout: float = 120.0) -> None:
        """Stop the workers; cancel the rollouts still sampling (the server stops them)."""
        with self._cond:
            self._stop = True
            in_flight = list(self._in_flight.values())
            self._cond.notify_all()
        for item in in_flight:
            for future in list(item.futures):
                future.cancel()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t.is_alive():
                t.join(max(deadline - time.monotonic(), 0.0))
