"""Treadle's own routes, beside the Tinker protocol, under /api/v1/treadle/."""

from __future__ import annotations

import io
import zipfile
from typing import Any

from fastapi import APIRouter, Response

from treadle.errors import NotFoundError
from treadle.server.api.deps import StateDep, TenantDep
from treadle.server.tenancy import metering

router = APIRouter(prefix="/api/v1/treadle")

# What AutoTokenizer.from_pretrained needs, for the tokenizer kinds HF folders hold.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)


@router.get("/models/{name:path}/tokenizer")
def get_tokenizer(name: str, state: StateDep) -> Response:
    """A zip of the served model's tokenizer files, flat; AutoTokenizer loads the folder
    they unpack to. `name` is the served name (may contain '/')."""
    if name not in state.tokenizer_dirs:
        raise NotFoundError(
            f"model {name!r} is not served here; served: {sorted(state.tokenizer_dirs)}"
        )
    folder = state.tokenizer_dirs[name]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for fname in TOKENIZER_FILES:
            if (folder / fname).is_file():
                zf.write(folder / fname, arcname=fname)
    return Response(content=buf.getvalue(), media_type="application/zip")


@router.get("/usage")
def get_usage(
    state: StateDep, tenant: TenantDep, since: str | None = None, by: str | None = None
) -> dict[str, Any]:
    """The caller's tenant's metered tokens and their cost (treadle.server.tenancy.metering):
    totals, or rows `by` session, day or model; `since` a date or ISO time (UTC)."""
    when = metering.usage_query(since, by)
    return metering.usage_report(
        state.store.engine, state.config.prices, tenant_id=tenant.tenant_id, since=when, by=by
    )


@router.get("/prices")
def get_prices(state: StateDep) -> dict[str, Any]:
    """The price table: per served model, $ per million prefill / sample / train tokens
    (what usage is charged at; a model without a row is not charged). For estimates before
    a run (ServiceClient.estimate_cost, `treadle estimate`)."""
    return {
        "unit": "USD per million tokens",
        "prices": {
            name: state.config.prices[name].model_dump() if name in state.config.prices else None
            for name in state.config.models
        },
    }


@router.get("/status")
def get_status(state: StateDep) -> dict[str, Any]:
    """Each served model's worker groups (replicas): health, worker process, device, how
    many sessions are placed there, queue depth, memory. Counts only: no tenant's ids."""
    models = []
    for engine in state.engines.all():
        replicas = [
            {
                "replica": r.replica,
                "status": r.status,
                "worker_pid": r.worker_pid,
                "device": r.device,
                "sessions": len(r.model_ids),
                "queue_depth": r.queue_depth,
                "running": r.running,
                "decode_batch": r.decode_batch,
                "memory_mb": _rss_mb(r.worker_pid),
                "reason": r.reason,  # why it is down for good (its model cannot load)
            }
            for r in engine.status()
        ]
        models.append({"model": engine.name, "replicas": replicas})
    return {"models": models}


def _rss_mb(pid: int | None) -> float | None:
    """A worker's resident memory, when it runs on this machine."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None
