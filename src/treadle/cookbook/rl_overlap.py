"""The overlapped RL loop: rollout workers keep sampling while the trainer steps.

    workers (threads) ── take a group, sample it with the newest policy, grade it ──► results
    trainer ── takes results as they complete ── staleness check ── forward_backward per
               sub-batch (streamed) ── one optim_step per step ── publishes the new policy

A group sampled by policy version v and consumed at step s is `s - v` steps old; at most
`max_steps_off_policy` (k). `stale_policy` says how that bound is kept:
- `pace` (the default; rl_pacing.py): admission control. At most one batch of groups starts
  per policy version, no new group starts while an older, due group is still sampling, and
  the trainer takes the oldest finished group first, waiting for a due one: no group is
  ever too stale, none is thrown away, and rollouts left when the run ends are cancelled.
- `requeue` / `drop` (the earlier rule): work for data step d is released once the trainer
  is at step d - k, and a group that comes back older than k is sampled again with the
  newest policy, or dropped. Slow (long) rollouts miss their window most, so the trained
  data leans towards short answers, and the discarded groups' sampling is lost.
k = 0 is the synchronous loop (the baseline of bench/code_rl.py). The loss defaults to
`cispo`, whose clipped importance weights correct for the policy lag.

Loss scaling: a group's datums carry advantage / (its action tokens * groups per step), so
the step's summed loss is the mean over groups of each group's per-token mean, whatever order
the sub-batches arrive in.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treadle import Datum, SamplingParams
from treadle.cookbook.rl import (
    RLConfig,
    evaluate,
    group_advantages,
    open_rl_run,
    record_step,
    rollout_groups,
    sampling_and_adam,
    trajectory_to_datum,
)
from treadle.cookbook.rl_pacing import PacedPool
from treadle.cookbook.rl_types import EnvGroupBuilder, RLDataset, Trajectory
from treadle.cookbook.run_dir import RunDir, step_bar
from treadle.errors import InvalidRequestError


@dataclass
class OverlapConfig(RLConfig):
    loss_fn: str = "cispo"
    batch_size: int = 4  # groups per step
    max_steps_off_policy: int = 1
    stale_policy: str = "pace"  # pace | requeue | drop
    rollout_workers: int = 4  # groups sampled and graded at once
    grade_workers: int = 8  # answers graded at once
    stream_groups: int = 1  # forward_backward as soon as this many groups are ready


# ---- staleness ---------------------------------------------------------------------------


@dataclass
class GroupLedger:
    """Decides for each completed group whether the trainer uses, requeues or drops it, and
    keeps the counts of the current step (and the staleness histogram of the used ones)."""

    max_steps_off_policy: int
    stale_policy: str = "pace"
    used: int = 0
    requeued: int = 0
    dropped: int = 0
    staleness: collections.Counter = field(default_factory=collections.Counter)

    def __post_init__(self) -> None:
        if self.stale_policy not in ("pace", "requeue", "drop"):
            raise InvalidRequestError(
                f"stale_policy must be 'pace', 'requeue' or 'drop', got {self.stale_policy!r}"
            )
        if self.max_steps_off_policy < 0:
            raise InvalidRequestError(
                f"max_steps_off_policy must be >= 0, got {self.max_steps_off_policy}"
            )

    def decide(self, sampled_version: int, step: int) -> str:
        lag = step - sampled_version
        if lag <= self.max_steps_off_policy or self.stale_policy == "pace":
            self.used += 1
            self.staleness[lag] += 1
            return "use"
        if self.stale_policy == "requeue":
            self.requeued += 1
        else:
            self.dropped += 1
        return self.stale_policy

    def step_metrics(self) -> dict[str, float]:
        """This step's counts (then reset for the next step)."""
        out = {
            "train/groups_used": float(self.used),
            "train/groups_requeued": float(self.requeued),
            "train/groups_dropped": float(self.dropped),
            "train/staleness_mean": (
                sum(k * n for k, n in self.staleness.items()) / max(self.used, 1)
            ),
        }
        for lag in range(self.max_steps_off_policy + 1):
            out[f"train/staleness_{lag}"] = float(self.staleness.get(lag, 0))
        self.used = self.requeued = self.dropped = 0
        self.staleness = collections.Counter()
        return out


# ---- workers ------------------------------------------------------------------------------


@dataclass
class WorkItem:
    data_step: int
    index: int
    builder: EnvGroupBuilder
    attempts: int = 0


@dataclass
class GroupResult:
    item: WorkItem
    version: int
    trajectories: list[Trajectory]
    sample_s: float
    grade_s: float


class RolloutPool:
    """Worker threads that sample and grade groups with the newest published policy."""

    def __init__(self, dataset: RLDataset, config: OverlapConfig, params: SamplingParams):
        self.dataset, self.config, self.params = dataset, config, params
        self.results: queue.Queue[GroupResult | BaseException] = queue.Queue()
        self._work: collections.deque[WorkItem] = collections.deque()
        self._cond = threading.Condition()
        self._in_flight = 0
        self.sampled_tokens = 0  # every finished group's, trained or not
        self._next_data_step = 0
        self._stop = False
        self._client: Any = None
        self._version = 0
        self.grade_pool = ThreadPoolExecutor(config.grade_workers, "grade")
        self._threads = [
            threading.Thread(target=self._run, name=f"rollout-{i}", daemon=True)
            for i in range(config.rollout_workers)
        ]

    def start(self, client, version: int, first_data_step: int) -> None:
        self.publish(client, version)
        self._next_data_step = first_data_step
        for t in self._threads:
            t.start()

    def publish(self, client, version: int) -> None:
        with self._cond:
            self._client, self._version = client, version

    def release_upto(self, data_step: int) -> None:
        """Queue the groups of every data step up to `data_step` not queued yet."""
        with self._cond:
            while self._next_data_step <= data_step:
                self._release_next()
            self._cond.notify_all()

    def ensure_work(self) -> None:
        """Dropped groups leave a step short: queue the next data step when nothing is left."""
        with self._cond:
            if not self._work and self._in_flight == 0 and self.results.empty():
                self._release_next()
                self._cond.notify_all()

    def _release_next(self) -> None:
        d = self._next_data_step
        self._work.extend(WorkItem(d, i, b) for i, b in enumerate(self.dataset.get_batch(d)))
        self._next_data_step += 1

    def requeue(self, item: WorkItem) -> None:
        with self._cond:
            item.attempts += 1
            self._work.appendleft(item)  # first in line: it is the oldest data
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._work and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                item = self._work.popleft()
                client, version = self._client, self._version
                self._in_flight += 1
            try:
                start = time.monotonic()
                groups = rollout_groups(
                    client, [item.builder], self.config.group_size, self.params, self.grade_pool
                )
                wall = time.monotonic() - start
                grade_s = _group_grade_s(groups[0])
                with self._cond:
                    self.sampled_tokens += _tokens(groups[0])
                self.results.put(GroupResult(item, version, groups[0], wall - grade_s, grade_s))
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it
                self.results.put(exc)
            finally:
                with self._cond:
                    self._in_flight -= 1

    def stop(self, timeout: float = 120.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t.is_alive():
                t.join(max(deadline - time.monotonic(), 0.0))
        self.grade_pool.shutdown(wait=False, cancel_futures=True)


def _tokens(trajectories: list[Trajectory]) -> int:
    return sum(len(tr.action) for t in trajectories for tr in t.transitions)


def _group_grade_s(trajectories: list[Trajectory]) -> float:
    """Grading seconds of a group, as the envs report them (`grade_s`): graded in parallel,
    so the slowest answer is the group's grading time."""
    return max((t.metrics.get("grade_s", 0.0) for t in trajectories), default=0.0)


# ---- datums --------------------------------------------------------------------------------


def group_datums(
    trajectories_G: list[Trajectory],
    groups_per_step: int,
    normalize_std: bool,
    remove_constant: bool,
) -> list[Datum]:
    """One group's datums with its share of the step's loss (see the module docstring);
    empty for a constant-reward group when those are removed."""
    rewards_G = [t.total_reward for t in trajectories_G]
    if remove_constant and max(rewards_G) - min(rewards_G) < 1e-8:
        return []
    advantages_G = group_advantages(rewards_G, normalize_std)
    n_action = sum(len(tr.action) for t in trajectories_G for tr in t.transitions)
    scale = 1.0 / (max(n_action, 1) * groups_per_step)
    return [
        trajectory_to_datum(t, float(a), scale)
        for t, a in zip(trajectories_G, advantages_G, strict=True)
    ]


# ---- the loop -----------------------------------------------------------------------------


def train_rl_overlapped(
    config: OverlapConfig,
    make_dataset: Callable[[Any], RLDataset],
    service=None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    on_group: Callable[[dict[str, float]], None] | None = None,
) -> RunDir:
    """Run (or resume) the overlapped loop; same contract as rl.train_rl. `on_group` hears
    of every finished group: trained (0/1), tokens, reward, lag, step."""
    ledger = GroupLedger(config.max_steps_off_policy, config.stale_policy)
    run, training_client, start_step, dataset = open_rl_run(config, make_dataset, service)
    params, adam = sampling_and_adam(config)
    sampling_client = training_client.save_weights_and_get_sampling_client()
    paced = config.stale_policy == "pace"
    pool = RolloutPool(dataset, config, params)
    if paced:
        pool = PacedPool(dataset, config, params, pool.grade_pool)
    pool.start(sampling_client, start_step, start_step)
    tell = on_group or (lambda _: None)
    try:
        bar = step_bar("code-rl", start_step, config.max_steps)
        for step in bar:
            metrics: dict[str, float] = {}
            if config.eval_every and step % config.eval_every == 0 and dataset.test_groups():
                metrics |= evaluate(
                    sampling_client, dataset.test_groups(), config, config.seed, pool.grade_pool
                )
            if not paced:
                pool.release_upto(step + config.max_steps_off_policy)
            metrics |= _train_step(step, config, pool, ledger, training_client, adam, tell)
            metrics["train/sampled_tokens_total"] = float(pool.sampled_tokens)
            sampling_client = training_client.save_weights_and_get_sampling_client()
            pool.publish(sampling_client, step + 1)
            record_step(run, training_client, config, step, metrics, on_step)
            bar.set_postfix(reward=f"{metrics['train/reward']:.3f}")
        if config.eval_every and dataset.test_groups():
            final = evaluate(
                sampling_client, dataset.test_groups(), config, config.seed, pool.grade_pool
            )
            run.log_metrics(config.max_steps, final)
            if on_step:
                on_step(config.max_steps, final)
    finally:
        pool.stop()
        pool.grade_pool.shutdown(wait=False, cancel_futures=True)
    run.close()
    return run


def _next_group(pool, ledger: GroupLedger, step: int, tell) -> GroupResult | None:
    """The next group the trainer uses at `step` (None: none yet; ask again)."""
    if isinstance(pool, PacedPool):
        res = pool.next_for(step)
        if res is not None:
            ledger.decide(res.version, step)
        return res
    pool.ensure_work()
    try:
        res = pool.results.get(timeout=0.1)
    except queue.Empty:
        return None
    if isinstance(res, BaseException):
        raise res
    decision = ledger.decide(res.version, step)
    if decision == "use":
        return res
    tell(_group_info(res, step, trained=False))
    if decision == "requeue":
        pool.requeue(res.item)
    return None


def _group_info(res, step: int, trained: bool) -> dict[str, float]:
    return {
        "trained": float(trained),
        "tokens": float(_tokens(res.trajectories)),
        "reward": float(np.mean([t.total_reward for t in res.trajectories])),
        "lag": float(step - res.version),
        "step": float(step),
    }


def _train_step(
    step: int,
    config: OverlapConfig,
    pool,
    ledger: GroupLedger,
    training_client,
    adam,
    tell: Callable[[dict[str, float]], None],
) -> dict[str, float]:
    start = time.monotonic()
    used: list[GroupResult] = []
    pending: list[Datum] = []
    pending_groups = 0
    futures = []
    n_constant = n_datums = 0
    train_s = 0.0
    paced = isinstance(pool, PacedPool)
    while len(used) < config.batch_size or (paced and pool.has_due(step)):
        res = _next_group(pool, ledger, step, tell)
        if res is None:
            continue
        tell(_group_info(res, step, trained=True))
        used.append(res)
        datums = group_datums(
            res.trajectories,
            config.batch_size,
            config.normalize_std,
            config.remove_constant_reward_groups,
        )
        n_constant += not datums
        n_datums += len(datums)
        pending += datums
        pending_groups += 1
        last = len(used) >= config.batch_size and not (paced and pool.has_due(step))
        if pending and (pending_groups >= config.stream_groups or last):
            t = time.monotonic()
            futures.append(training_client.forward_backward(pending, loss_fn=config.loss_fn))
            train_s += time.monotonic() - t
            pending, pending_groups = [], 0
    t = time.monotonic()
    if futures:
        optim = training_client.optim_step(adam)
        for f in futures:
            f.result()
        optim.result()
    train_s += time.monotonic() - t
    trajectories = [t for r in used for t in r.trajectories]
    tokens = sum(len(tr.action) for t in trajectories for tr in t.transitions)
    mean = lambda key: float(np.mean([t.metrics.get(key, 0.0) for t in trajectories]))  # noqa: E731
    return {
        "train/reward": float(np.mean([t.total_reward for t in trajectories])),
        "train/pass_rate": mean("pass_rate"),
        "train/correct": mean("correct"),
        "train/formatted": mean("formatted"),
        "train/tool_calls": mean("tool_calls"),
        "train/tokens": float(tokens),
        "train/datums": float(n_datums),
        "train/groups_constant": float(n_constant),
        "train/fwd_bwd_calls": float(len(futures)),
        **ledger.step_metrics(),
        "time/sample_s": sum(r.sample_s for r in used),
        "time/grade_s": sum(r.grade_s for r in used),
        "time/train_s": train_s,
        "time/step_s": time.monotonic() - start,
    }
