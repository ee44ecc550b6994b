"""Checkpoints on the Tinker protocol: save_state, save_weights_for_sampler,
save_weights_external, load_weights, and the RestClient's runs, checkpoint listings,
weights_info, TTL, deletion and file download (external_weights_urls).

`tinker checkpoint download` (SDK 0.38) loads a training checkpoint into a new run, saves it
as external weights, asks external_weights_urls for one signed URL per file, downloads them
and deletes the export: the routes below serve each step. Signed URLs are HMACs of the
checkpoint and an expiry under a per-process secret (a restart invalidates them).
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import hmac
import json
import os
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select

from treadle.errors import InvalidRequestError, NotFoundError
from treadle.server import artifacts, encryption, handlers, registry
from treadle.server.db import CheckpointRow, ModelRow
from treadle.server.deps import ServiceDep, TenantDep
from treadle.types import Checkpoint, TrainingRun
from treadle.wire.requests import (
    CheckpointsListResponse,
    Cursor,
    LoadWeightsRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    TrainingRunsResponse,
    WeightsInfoRequest,
    WeightsInfoResponse,
)

router = APIRouter(prefix="/api/v1")

URL_TTL_S = 3600
_SECRET = os.urandom(32)


def request_key(request: Request) -> bytes | None:
    """The tenant's encryption key of this request, if it sent one (never stored)."""
    return encryption.parse_key(request.headers.get(encryption.HEADER))


async def fetch_source(
    svc: Any, tenant_id: str, path: str, request: Request, optimizer: bool
) -> registry.LoadSource | None:
    """registry.load_source off the event loop (it may download and decrypt) with the
    request's key; None for a plain tinker:// checkpoint on this server's disk."""
    root = registry.packages_root(svc.config)
    key = request_key(request)
    return await asyncio.to_thread(
        registry.load_source, svc.store, root, tenant_id, path, key, optimizer
    )


def _owned(stmt: Any, table: Any, tenant_id: str) -> Any:
    """Filter by tenant when the table carries tenant_id (the tenants work adds it)."""
    column = getattr(table, "tenant_id", None)
    return stmt.where(column == tenant_id) if column is not None else stmt


# ---- saves and loads ----
@router.post("/save_weights")
async def save_weights(body: SaveWeightsRequest, svc: ServiceDep, request: Request) -> dict:
    return await handlers.save_weights(svc, body, key=request_key(request))


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    body: SaveWeightsForSamplerRequest, svc: ServiceDep, request: Request
) -> dict[str, Any]:
    return await handlers.save_weights_for_sampler(svc, body, key=request_key(request))


class SaveWeightsExternalRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None
    type: Literal["save_weights_external"] = "save_weights_external"


@router.post("/save_weights_external")
async def save_weights_external(
    body: SaveWeightsExternalRequest, svc: ServiceDep, request: Request
) -> dict[str, Any]:
    """The PEFT adapter, as tinker://<run>/external_weights/<name>, for file download; with
    age_encryption_recipients every file is stored as <name>.age, encrypted to them."""
    as_sampler = SaveWeightsForSamplerRequest(
        model_id=body.model_id, path=body.path, seq_id=body.seq_id, ttl_seconds=body.ttl_seconds
    )
    return await handlers.save_weights_for_sampler(
        svc,
        as_sampler,
        key=request_key(request),
        checkpoint_type="external",
        age_recipients=body.age_encryption_recipients,
    )


@router.post("/load_weights")
async def load_weights(
    body: LoadWeightsRequest, svc: ServiceDep, tenant: TenantDep, request: Request
) -> dict[str, Any]:
    """`path`: a tinker:// checkpoint, or a model package version GROUP:N / GROUP:latest."""
    source = await fetch_source(svc, tenant.tenant_id, body.path, request, body.optimizer)
    try:
        return await handlers.load_weights(svc, body, source=source)
    except BaseException:
        if source is not None and source.cleanup:
            shutil.rmtree(source.dir, ignore_errors=True)
        raise


@router.post("/weights_info")
async def weights_info(
    body: WeightsInfoRequest, svc: ServiceDep, tenant: TenantDep
) -> WeightsInfoResponse:
    """A tinker:// checkpoint or a version reference → what loading it needs."""
    if registry.is_ref(body.tinker_path):
        v = registry.get_version(svc.store, tenant.tenant_id, body.tinker_path)
        base_model, lora = v.base_model, v.lora_config or {}
        is_lora = v.kind != "merged"
    else:
        ckpt = await svc.checkpoint(body.tinker_path, "tinker_path")
        base_model, lora, is_lora = ckpt.base_model, ckpt.lora_config, True
    return WeightsInfoResponse(
        base_model=base_model,
        is_lora=is_lora,
        lora_rank=lora.get("rank"),
        train_unembed=lora.get("train_unembed"),
        train_mlp=lora.get("train_mlp"),
        train_attn=lora.get("train_attn"),
    )


# ---- RestClient: runs and checkpoints ----
def checkpoint_view(row: CheckpointRow) -> Checkpoint:
    segment = artifacts.SEGMENT_OF_TYPE[row.checkpoint_type]
    expires = getattr(row, "expires_at", None)
    return Checkpoint(
        checkpoint_id=f"{segment}/{row.name}",
        checkpoint_type=row.checkpoint_type,
        time=row.created_at.isoformat(),
        tinker_path=row.tinker_path,
        size_bytes=row.size_bytes,
        user_metadata=row.user_metadata,
        expires_at=expires.isoformat() if expires else None,
    )


def run_view(svc: Any, row: ModelRow) -> TrainingRun:
    ckpts = svc.store.query(
        select(CheckpointRow)
        .where(CheckpointRow.run_id == row.run_id)
        .order_by(CheckpointRow.created_at.desc())
    )
    last = next((c for c in ckpts if c.checkpoint_type == "training"), None)
    last_sampler = next((c for c in ckpts if c.checkpoint_type == "sampler"), None)
    return TrainingRun(
        training_run_id=row.run_id,
        base_model=row.base_model,
        lora_rank=row.lora_config.get("rank"),
        last_request_time=row.last_request_time.isoformat(),
        last_checkpoint=checkpoint_view(last) if last else None,
        last_sampler_checkpoint=checkpoint_view(last_sampler) if last_sampler else None,
        user_metadata={k: str(v) for k, v in (row.user_metadata or {}).items()} or None,
    )


def _run(svc: Any, run_id: str, tenant_id: str) -> ModelRow:
    run = svc.find_run(run_id)
    owner = getattr(run, "tenant_id", None)
    if owner is not None and owner != tenant_id:
        raise NotFoundError(f"training run {run_id!r} not found")
    return run


@router.get("/training_runs")
def list_training_runs(
    svc: ServiceDep, tenant: TenantDep, limit: int = 20, offset: int = 0
) -> TrainingRunsResponse:
    stmt = _owned(select(ModelRow), ModelRow, tenant.tenant_id).order_by(ModelRow.created_at.desc())
    rows = svc.store.query(stmt.offset(offset).limit(limit))
    return TrainingRunsResponse(
        training_runs=[run_view(svc, r) for r in rows],
        cursor=Cursor(offset=offset, limit=limit, total_count=svc.store.count(stmt)),
    )


@router.get("/training_runs/{run_id}")
def get_training_run(run_id: str, svc: ServiceDep, tenant: TenantDep) -> TrainingRun:
    """run_id: a training run id, or a model id (the Tinker SDK passes either)."""
    return run_view(svc, _run(svc, run_id, tenant.tenant_id))


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(
    run_id: str, svc: ServiceDep, tenant: TenantDep
) -> CheckpointsListResponse:
    run = _run(svc, run_id, tenant.tenant_id)
    rows = svc.store.query(
        select(CheckpointRow)
        .where(CheckpointRow.run_id == run.run_id)
        .order_by(CheckpointRow.created_at.desc())
    )
    return CheckpointsListResponse(checkpoints=[checkpoint_view(r) for r in rows])


@router.get("/checkpoints")
def list_checkpoints(
    svc: ServiceDep, tenant: TenantDep, limit: int = 100, offset: int = 0
) -> CheckpointsListResponse:
    stmt = _owned(select(CheckpointRow), CheckpointRow, tenant.tenant_id).order_by(
        CheckpointRow.created_at.desc()
    )
    rows = svc.store.query(stmt.offset(offset).limit(limit))
    return CheckpointsListResponse(
        checkpoints=[checkpoint_view(r) for r in rows],
        cursor=Cursor(offset=offset, limit=limit, total_count=svc.store.count(stmt)),
    )


def _checkpoint(svc: Any, run_id: str, checkpoint_id: str, tenant_id: str) -> CheckpointRow:
    run = _run(svc, run_id, tenant_id)
    path = f"tinker://{run.run_id}/{checkpoint_id}"
    artifacts.parse_tinker_path(path, "checkpoint_id")
    row = svc.store.get(CheckpointRow, path)
    if row is None:
        raise NotFoundError(f"checkpoint {path!r} not found")
    return row


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(
    run_id: str, checkpoint_id: str, svc: ServiceDep, tenant: TenantDep
) -> dict[str, Any]:
    """Delete the checkpoint's files and row (versions published from it stay: they are
    copies in the group's store, deleted through the registry)."""
    row = _checkpoint(svc, run_id, checkpoint_id, tenant.tenant_id)
    with svc.store.session.begin() as s:
        s.delete(s.get(CheckpointRow, row.tinker_path))
    shutil.rmtree(row.dir, ignore_errors=True)
    return {}


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
def set_checkpoint_ttl(
    run_id: str,
    checkpoint_id: str,
    svc: ServiceDep,
    tenant: TenantDep,
    body: Annotated[dict[str, Any] | None, Body()] = None,
) -> dict[str, Any]:
    """Accepted and checked; checkpoints here do not expire by themselves (retention of
    model package groups does that)."""
    _checkpoint(svc, run_id, checkpoint_id, tenant.tenant_id)
    ttl = (body or {}).get("ttl_seconds")
    if ttl is not None and (not isinstance(ttl, int) or ttl <= 0):
        raise InvalidRequestError(f"ttl_seconds: expected a positive integer or null, got {ttl!r}")
    return {}


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
def external_weights_urls(
    run_id: str, checkpoint_id: str, svc: ServiceDep, tenant: TenantDep, request: Request
) -> dict[str, Any]:
    """One signed download URL per file of the checkpoint, valid for URL_TTL_S."""
    row = _checkpoint(svc, run_id, checkpoint_id, tenant.tenant_id)
    folder = Path(row.dir)
    if not folder.is_dir():
        raise NotFoundError(f"checkpoint {row.tinker_path!r}: its files are not on this server")
    expires = int(dt.datetime.now(dt.UTC).timestamp()) + URL_TTL_S
    token = _sign({"path": row.tinker_path, "exp": expires})
    base = str(request.base_url).rstrip("/")
    urls = {
        name: f"{base}/api/v1/treadle/files/{token}/{name}"
        for name in sorted(
            p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
        )
    }
    return {"urls": urls, "expires": dt.datetime.fromtimestamp(expires, dt.UTC).isoformat()}


def _sign(claims: dict[str, Any]) -> str:
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    mac = hmac.new(_SECRET, body.encode(), hashlib.sha256).hexdigest()[:32]
    return f"{body}.{mac}"


def _verify(token: str) -> dict[str, Any]:
    body, _, mac = token.partition(".")
    good = hmac.new(_SECRET, body.encode(), hashlib.sha256).hexdigest()[:32]
    if not hmac.compare_digest(mac, good):
        raise NotFoundError("download link: invalid signature")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    if claims["exp"] < dt.datetime.now(dt.UTC).timestamp():
        raise NotFoundError("download link: expired; ask external_weights_urls again")
    return claims


@router.get("/treadle/files/{token}/{name:path}")
def download_file(token: str, name: str, svc: ServiceDep) -> FileResponse:
    """A file of a checkpoint, by a signed URL (no API key: the signature is the grant)."""
    claims = _verify(token)
    row = svc.store.get(CheckpointRow, claims["path"])
    if row is None:
        raise NotFoundError(f"checkpoint {claims['path']!r} not found")
    folder = Path(row.dir).resolve()
    target = (folder / name).resolve()
    if not target.is_relative_to(folder) or not target.is_file():
        raise NotFoundError(f"file {name!r} not in checkpoint {row.tinker_path!r}")
    return FileResponse(target, media_type="application/octet-stream")
