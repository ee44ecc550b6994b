"""The metrics' outcome listener (treadle.server.core.listeners): op latency and queue wait
by op kind, ops by kind and status, and metered tokens by kind and tenant.

`filed` (the event loop, in the request's context) notes the op's kind, when it was filed
(wall-clock seconds, as the engine stamps started_at / finished_at) and its tenant's label;
`finished` (the journal thread, after the results are committed) observes:
- queue wait = started_at - filed, op latency = finished_at - filed (ops that reached an
  engine; a refused op is only counted);
- tokens: prompt (prefill), sampled (sample) and trained (train) tokens of successful ops.

Tenant labels are a bounded set (TenantLabels): a Prometheus series per tenant is fine for
tens of tenants, not for thousands. Ops a previous run left unfinished were not filed here:
they are not observed.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from treadle.protocol.ops import Op, Outcome
from treadle.server.observe import metrics
from treadle.server.tenancy.auth import current_tenant

MAX_PENDING = 100_000  # ops noted and not finished (a lost one must not grow the server)
OTHER = "other"


class TenantLabels:
    """The label of a tenant: its name for the first `limit` tenants seen, else "other"."""

    def __init__(self, limit: int):
        self.limit = limit
        self._labels: dict[str, str] = {}
        self._lock = threading.Lock()

    def of(self, tenant_id: str, name: str) -> str:
        label = self._labels.get(tenant_id)
        if label is not None:
            return label
        with self._lock:
            if tenant_id not in self._labels:
                full = len(self._labels) >= self.limit
                self._labels[tenant_id] = OTHER if full else name
            return self._labels[tenant_id]


@dataclass(frozen=True)
class _Note:
    kind: str
    filed_at: float
    tenant: str


class MetricsListener:
    def __init__(self, max_tenants: int):
        self.tenants = TenantLabels(max_tenants)
        self._lock = threading.Lock()
        self._filed: OrderedDict[str, _Note] = OrderedDict()

    def filed(self, op: Op, values: Mapping[str, Any]) -> None:
        tenant = current_tenant()
        tenant_id = values.get("tenant_id") or tenant.tenant_id
        name = tenant.name if tenant.tenant_id == tenant_id else tenant_id
        note = _Note(str(op.kind), time.time(), self.tenants.of(tenant_id, name))
        with self._lock:
            self._filed[op.request_id] = note
            if len(self._filed) > MAX_PENDING:
                self._filed.popitem(last=False)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._filed.pop(request_id, None)

    def finished(self, outcomes: list[Outcome]) -> None:
        with self._lock:
            notes = [(o, n) for o in outcomes if (n := self._filed.pop(o.request_id, None))]
        for o, n in notes:
            metrics.child(metrics.OPS, n.kind, "done" if o.succeeded else "failed").inc()
            if o.started_at is not None:
                queued = max(0.0, o.started_at - n.filed_at)
                metrics.child(metrics.OP_QUEUE, n.kind).observe(queued)
            if o.finished_at is not None:
                latency = max(0.0, o.finished_at - n.filed_at)
                metrics.child(metrics.OP_LATENCY, n.kind).observe(latency)
            if o.succeeded:
                u = o.usage
                for kind, count in (
                    ("prefill", u.prompt_tokens),
                    ("sample", u.sampled_tokens),
                    ("train", u.train_tokens),
                ):
                    if count:
                        metrics.child(metrics.TOKENS, kind, n.tenant).inc(count)

    def __len__(self) -> int:
        with self._lock:
            return len(self._filed)
