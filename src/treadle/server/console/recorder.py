"""The console's recorder: per-step figures, the request timeline and live engine figures,
recorded as an outcome listener (treadle.server.core.listeners) that the app adds only when
the console is on.

- Filing (`filed`, on the event loop) notes each op's context in memory: tenant, key,
  session, model, served model, kind, when it was filed, and for a forward_backward the
  tokens its loss counts (non-zero weights or advantages) and its datums.
- Finishing (`finished`, once the results are committed and their polls woken, on the
  journal thread in commit order) numbers the steps and records, in memory:
  - one op_records row per op: filed / started / finished times, status, usage, the number
    of ops in the same engine call, and the step of a training op;
  - the step figures of a training model (step_figures): step s of a model is the number of
    optim_steps it completed before; each forward_backward adds to its step's loss sum,
    loss tokens and tokens, an optim_step sets grad_norm and learning_rate and closes the
    step (their names and their write: treadle.server.console.figures).
  Spend is not counted here (treadle.server.tenancy.spend_listener): an op this recorder
  let go of (MAX_PENDING) only misses its row in the console.
- A thread of its own writes what was recorded through the journal, FLUSH_S after the first
  of it, in one write: a result is never held up by its figures, nor a loop's next request
  by its last one's (a crash loses at most the last FLUSH_S of figures; results are never
  at stake). A write that fails is logged and dropped.
- In memory, for the overview: the ops in flight per served model and tenant, and the sizes
  of recent engine calls (ops and rows per call).

Steps are numbered per training model by this process, in the order results are committed
(each model's seq_id order); a model made from a checkpoint starts at step 0 again (the
loop's own metrics carry the loop's step).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import Connection, insert

from treadle.protocol.ops import (
    TRAIN_KINDS,
    Op,
    OpKind,
    OptimResult,
    Outcome,
    Sample,
    TrainData,
)
from treadle.server.console.figures import (
    GRAD_NORM,
    LEARNING_RATE,
    LOSS,
    LOSS_SUM,
    LOSS_TOKENS,
    TOKENS,
    write_figures,
)
from treadle.server.storage.journal import Journal
from treadle.server.storage.rows import OpRecordRow

log = logging.getLogger("treadle.console")

OP_RECORDS = OpRecordRow.__table__
# Ops filed and not finished, remembered in memory (a lost one must not grow the server).
MAX_PENDING = 100_000
# Engine calls remembered per served model for the batch sizes of the overview.
MAX_CALLS = 4096
# How long recorded figures gather before one write (a loop's next request never waits on them).
FLUSH_S = 0.2


@dataclass
class OpNote:
    """What the console needs to know of one op, noted when it is filed."""

    kind: OpKind
    tenant_id: str
    key_id: str | None
    session_id: str | None
    model_id: str | None
    base_model: str | None
    queued_at: float  # wall-clock seconds
    rows: int = 0  # datums of a training op, samples of a sample op
    loss_tokens: int = 0  # targets with a non-zero weight (forward_backward)
    tokens: int = 0  # model-input tokens (forward_backward)


@dataclass
class Call:
    """One engine call: when it ended, what it ran, and each tenant's (ops, rows) in it."""

    at: float
    group: str  # train | sample
    by_tenant: dict[str, tuple[int, int]]


@dataclass
class StepSums:
    step: int
    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))


class Recorder:
    def __init__(self, journal: Journal):
        self.journal = journal
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, OpNote] = OrderedDict()
        self._calls: dict[str, deque[Call]] = defaultdict(lambda: deque(maxlen=MAX_CALLS))
        self._steps: dict[str, int] = {}  # model_id → optim_steps recorded
        self._open: dict[str, StepSums] = {}  # model_id → its current step's sums
        # recorded, not yet written: op_records rows, and step figures by (model, step)
        self._records: list[dict[str, Any]] = []
        self._figures: dict[tuple[str, int], tuple[OpNote, dict[str, float]]] = {}
        self._wake = threading.Condition(self._lock)
        self._flush_lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="console-recorder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Write what is recorded (before the journal stops)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(30)
        self.flush()

    # ---- the outcome listener (Futures) ----
    def filed(self, op: Op, values: Mapping[str, Any]) -> None:
        """Note an op being filed (`values`: its request row's columns)."""
        f = OpNote(
            kind=op.kind,
            tenant_id=values["tenant_id"],
            key_id=values.get("key_id"),
            session_id=values.get("session_id"),
            model_id=op.model_id,
            base_model=values.get("base_model"),
            queued_at=time.time(),
        )
        p = op.payload
        if isinstance(p, TrainData):
            f.rows, f.tokens = len(p.data), p.n_tokens
            f.loss_tokens = sum(_loss_tokens(d.tokens, d.loss_inputs) for d in p.data)
        elif isinstance(p, Sample):
            f.rows = p.request.num_samples
        with self._lock:
            self._pending[op.request_id] = f
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)

    def forget(self, request_id: str) -> None:
        """A filing that was never committed: nothing will finish."""
        with self._lock:
            self._pending.pop(request_id, None)

    def finished(self, outcomes: list[Outcome]) -> None:
        """Record outcomes whose results are committed (the journal thread, in commit order;
        never blocks): steps are numbered here, the rows are written a moment later."""
        with self._lock:
            entries = [(o, f) for o in outcomes if (f := self._pending.pop(o.request_id, None))]
            if not entries:
                return
            self._note_calls(entries)
            per_call = Counter(o.started_at for o, _ in entries if o.started_at is not None)
            idle = not self._records
            for o, f in entries:
                step = self._figures_of(o, f)
                self._records.append(_record(o, f, step, per_call))
            if idle:  # the writer waits for a first record, then gathers for FLUSH_S
                self._wake.notify()

    def _note_calls(self, entries: list[tuple[Outcome, OpNote]]) -> None:
        # The outcomes of one engine call share its start time.
        calls: dict[tuple[str, float, str], dict[str, tuple[int, int]]] = {}
        for o, f in entries:
            group = (
                "train" if f.kind in TRAIN_KINDS else "sample" if f.kind == OpKind.SAMPLE else None
            )
            if group is None or o.started_at is None or f.base_model is None:
                continue
            by_tenant = calls.setdefault((f.base_model, o.started_at, group), {})
            ops, rows = by_tenant.get(f.tenant_id, (0, 0))
            by_tenant[f.tenant_id] = (ops + 1, rows + f.rows)
        for (base_model, _, group), by_tenant in calls.items():
            self._calls[base_model].append(Call(time.time(), group, by_tenant))

    # ---- writing: off the path of results ----
    def _run(self) -> None:
        # Gather for FLUSH_S once something is recorded, then write it all in one journal
        # write: a loop's next request never queues behind its last one's figures.
        while True:
            with self._wake:
                while not self._stopping and not (self._records or self._figures):
                    self._wake.wait()
                if self._stopping:
                    return
                self._wake.wait_for(lambda: self._stopping, FLUSH_S)
            self.flush()

    def flush(self) -> None:
        """Write what is recorded and wait for its commit (any thread but the journal's)."""
        with self._flush_lock:
            with self._lock:
                records, figures = self._records, self._figures
                self._records, self._figures = [], {}
            if not records and not figures:
                return
            try:
                self.journal.call(functools.partial(_write, records=records, figures=figures))
            except Exception:
                log.warning("could not record the figures of %d ops", len(records), exc_info=True)

    def _figures_of(self, o: Outcome, f: OpNote) -> int | None:
        """The step of a training op; its figures go into the step's (under the lock)."""
        if f.model_id is None or f.kind not in (OpKind.FORWARD_BACKWARD, OpKind.OPTIM_STEP):
            return None
        step = self._steps.get(f.model_id, 0)
        if not o.succeeded:
            return step
        key = (f.model_id, step)
        values = self._figures.setdefault(key, (f, {}))[1]
        if f.kind == OpKind.FORWARD_BACKWARD:
            sums = self._open.get(f.model_id)
            if sums is None or sums.step != step:
                sums = self._open[f.model_id] = StepSums(step)
            loss = getattr(o.result, "metrics", {}).get("loss:sum")
            if loss is not None and math.isfinite(loss):
                sums.sums[LOSS_SUM] += float(loss)
            sums.sums[LOSS_TOKENS] += f.loss_tokens
            sums.sums[TOKENS] += f.tokens
            values.update(sums.sums)
            if LOSS_SUM in sums.sums and sums.sums[LOSS_TOKENS] > 0:
                values[LOSS] = sums.sums[LOSS_SUM] / sums.sums[LOSS_TOKENS]
            return step
        metrics = o.result.metrics if isinstance(o.result, OptimResult) else {}
        for name, k in ((GRAD_NORM, "grad_norm:mean"), (LEARNING_RATE, "learning_rate:mean")):
            if k in metrics and math.isfinite(metrics[k]):
                values[name] = float(metrics[k])
        self._steps[f.model_id] = step + 1
        self._open.pop(f.model_id, None)
        return step

    # ---- live figures (the overview) ----
    def in_flight(self, base_model: str, tenant_id: str | None) -> int:
        with self._lock:
            return sum(
                1
                for f in self._pending.values()
                if f.base_model == base_model and tenant_id in (None, f.tenant_id)
            )

    def batch_sizes(
        self, base_model: str, tenant_id: str | None, window_s: float = 300.0
    ) -> dict[str, dict[str, float]]:
        """Per call group (train, sample): engine calls in the last window_s, and their ops
        and rows, mean and max (a tenant sees its own ops of each call only)."""
        since = time.time() - window_s
        with self._lock:
            calls = [c for c in self._calls.get(base_model, ()) if c.at >= since]
        out = {}
        for group in ("train", "sample"):
            sizes = []
            for c in calls:
                if c.group != group:
                    continue
                mine = [v for t, v in c.by_tenant.items() if tenant_id in (None, t)]
                if mine:
                    sizes.append((sum(v[0] for v in mine), sum(v[1] for v in mine)))
            ops = [s[0] for s in sizes]
            rows = [s[1] for s in sizes]
            out[group] = {
                "calls": len(sizes),
                "mean_ops": float(np.mean(ops)) if ops else 0.0,
                "max_ops": max(ops, default=0),
                "mean_rows": float(np.mean(rows)) if rows else 0.0,
                "max_rows": max(rows, default=0),
            }
        return out


def _record(o: Outcome, f: OpNote, step: int | None, per_call: Counter) -> dict[str, Any]:
    """The op_records row of one outcome."""
    u = o.usage
    return {
        "request_id": o.request_id,
        "tenant_id": f.tenant_id,
        "key_id": f.key_id,
        "session_id": f.session_id,
        "model_id": f.model_id,
        "base_model": f.base_model,
        "kind": str(f.kind),
        "status": "done" if o.succeeded else "failed",
        "error": o.error.message[:500] if o.error is not None else None,
        "queued_at": f.queued_at,
        "started_at": o.started_at,
        "finished_at": _end(o),
        "batch_ops": per_call.get(o.started_at, 1) if o.started_at is not None else 1,
        "step": step,
        "prompt_tokens": u.prompt_tokens,
        "sampled_tokens": u.sampled_tokens,
        "train_tokens": u.train_tokens,
    }


def _write(
    conn: Connection,
    records: list[dict[str, Any]],
    figures: dict[tuple[str, int], tuple[OpNote, dict[str, float]]],
) -> None:
    if records:
        conn.execute(insert(OP_RECORDS), records)
    now = time.time()
    for (model_id, step), (f, values) in figures.items():
        write_figures(conn, f.tenant_id, f.session_id or "", model_id, step, values, "server", now)


def _loss_tokens(tokens: np.ndarray, loss_inputs: Mapping[str, np.ndarray]) -> int:
    """Targets the loss counts: non-zero weights (cross_entropy) or advantages (the RL
    losses); every position without either."""
    for name in ("weights", "advantages"):
        if name in loss_inputs:
            return int(np.count_nonzero(loss_inputs[name]))
    return int(len(tokens))


def _end(o: Outcome) -> float:
    return o.finished_at if o.finished_at is not None else time.time()
