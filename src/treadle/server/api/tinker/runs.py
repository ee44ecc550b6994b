"""The RestClient's training runs and checkpoints: listings, TTL, publication, deletion,
file download.

`tinker checkpoint download` (SDK 0.38) loads a training checkpoint into a new run, saves it
as external weights, asks external_weights_urls for one signed URL per file, downloads them
and deletes the export: these routes (with save_weights_external) serve each step. A signed
URL needs no API key: its signature is the grant (treadle.server.tenancy.signing).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import FileResponse

from treadle.artifacts import folders as artifacts
from treadle.errors import NotFoundError
from treadle.server.api.deps import StateDep, TenantDep
from treadle.server.core import lifetime
from treadle.server.core.state import ServerState
from treadle.server.storage.rows import CheckpointRow, ModelRow
from treadle.server.tenancy.signing import URL_TTL_S
from treadle.types import Checkpoint, TrainingRun
from treadle.wire.requests import CheckpointsListResponse, Cursor, TrainingRunsResponse
from treadle.wire.sdk_requests import CheckpointTtlRequest

router = APIRouter(prefix="/api/v1")

MAX_PAGE = 1000
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE)]
Offset = Annotated[int, Query(ge=0, le=2**62)]


def checkpoint_view(row: CheckpointRow) -> Checkpoint:
    segment = artifacts.SEGMENT_OF_TYPE[row.checkpoint_type]
    return Checkpoint(
        checkpoint_id=f"{segment}/{row.name}",
        checkpoint_type=row.checkpoint_type,
        time=row.created_at.isoformat(),
        tinker_path=row.tinker_path,
        size_bytes=row.size_bytes,
        public=bool(row.public),
        user_metadata=row.user_metadata,
        expires_at=_iso(lifetime.aware(row.expires_at)),
    )


def _iso(when: dt.datetime | None) -> str | None:
    return when.isoformat() if when is not None else None


def run_view(state: ServerState, row: ModelRow) -> TrainingRun:
    ckpts = state.checkpoints.run_checkpoints(row)
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


@router.get("/training_runs")
def list_training_runs(
    state: StateDep,
    tenant: TenantDep,
    limit: Limit = 20,
    offset: Offset = 0,
    project_id: str | None = None,
) -> TrainingRunsResponse:
    rows, total = state.checkpoints.runs_page(tenant.tenant_id, limit, offset, project_id)
    return TrainingRunsResponse(
        training_runs=[run_view(state, r) for r in rows],
        cursor=Cursor(offset=offset, limit=limit, total_count=total),
    )


@router.get("/training_runs/{run_id}")
def get_training_run(run_id: str, state: StateDep) -> TrainingRun:
    """run_id: a training run id, or a model id (the Tinker SDK passes either)."""
    return run_view(state, state.models.find_run(run_id))


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, state: StateDep) -> CheckpointsListResponse:
    rows = state.checkpoints.run_checkpoints(state.models.find_run(run_id))
    return CheckpointsListResponse(checkpoints=[checkpoint_view(r) for r in rows])


@router.get("/checkpoints")
def list_checkpoints(
    state: StateDep, tenant: TenantDep, limit: Limit = 100, offset: Offset = 0
) -> CheckpointsListResponse:
    rows, total = state.checkpoints.page(tenant.tenant_id, limit, offset)
    return CheckpointsListResponse(
        checkpoints=[checkpoint_view(r) for r in rows],
        cursor=Cursor(offset=offset, limit=limit, total_count=total),
    )


def _checkpoint(state: ServerState, run_id: str, checkpoint_id: str) -> CheckpointRow:
    return state.checkpoints.of_run(state.models.find_run(run_id), checkpoint_id)


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
def set_checkpoint_ttl(
    run_id: str,
    checkpoint_id: str,
    state: StateDep,
    body: Annotated[CheckpointTtlRequest | None, Body()] = None,
) -> dict[str, Any]:
    """The checkpoint's files are deleted ttl_seconds from now (null: never); the server's
    sweep deletes them, and the versions published from it in groups without a retention
    rule (treadle.server.core.lifetime). → {expires_at}."""
    row = _checkpoint(state, run_id, checkpoint_id)
    when = lifetime.set_ttl(state.store, row, body.ttl_seconds if body else None)
    return {"tinker_path": row.tinker_path, "expires_at": _iso(when)}


@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
def publish_checkpoint(run_id: str, checkpoint_id: str, state: StateDep) -> dict[str, Any]:
    """Make the checkpoint readable by every tenant of this server: they may sample from
    it, load it into a training client, or copy it (copy_weights); only its owner lists,
    deletes, unpublishes or sets its TTL."""
    row = _checkpoint(state, run_id, checkpoint_id)
    state.checkpoints.publish(row, True)
    return {"tinker_path": row.tinker_path, "public": True}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
def unpublish_checkpoint(run_id: str, checkpoint_id: str, state: StateDep) -> dict[str, Any]:
    """Readable by its owner's tenant only again (copies others made stay theirs)."""
    row = _checkpoint(state, run_id, checkpoint_id)
    state.checkpoints.publish(row, False)
    return {"tinker_path": row.tinker_path, "public": False}


# after the routes under a checkpoint: its {checkpoint_id:path} would take their tails
@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(run_id: str, checkpoint_id: str, state: StateDep) -> dict[str, Any]:
    """Delete the checkpoint's files and row (versions published from it stay: they are
    copies in the group's store, deleted through the registry)."""
    state.checkpoints.delete(_checkpoint(state, run_id, checkpoint_id))
    return {}


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
def external_weights_urls(
    run_id: str, checkpoint_id: str, state: StateDep, request: Request
) -> dict[str, Any]:
    """One signed download URL per file of the checkpoint, valid for URL_TTL_S."""
    row = _checkpoint(state, run_id, checkpoint_id)
    folder = Path(row.dir)
    if not folder.is_dir():
        raise NotFoundError(f"checkpoint {row.tinker_path!r}: its files are not on this server")
    expires = int(dt.datetime.now(dt.UTC).timestamp()) + URL_TTL_S
    token = state.signer.sign({"path": row.tinker_path, "exp": expires})
    base = str(request.base_url).rstrip("/")
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    urls = {name: f"{base}/api/v1/treadle/files/{token}/{name}" for name in files}
    return {"urls": urls, "expires": dt.datetime.fromtimestamp(expires, dt.UTC).isoformat()}


@router.get("/treadle/files/{token}/{name:path}")
def download_file(token: str, name: str, state: StateDep) -> FileResponse:
    """A file of a checkpoint, by a signed URL (no API key: the signature is the grant)."""
    claims = state.signer.verify(token)
    row = state.store.get(CheckpointRow, claims["path"])
    if row is None:
        raise NotFoundError(f"checkpoint {claims['path']!r} not found")
    folder = Path(row.dir).resolve()
    target = (folder / name).resolve()
    if not target.is_relative_to(folder) or not target.is_file():
        raise NotFoundError(f"file {name!r} not in checkpoint {row.tinker_path!r}")
    return FileResponse(target, media_type="application/octet-stream")
