"""Checkpoints: save_state, save_weights_for_sampler, load_weights, and their listings."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from sqlalchemy import select

from treadle.errors import InvalidRequestError
from treadle.server import handlers
from treadle.server.db import CheckpointRow, ModelRow
from treadle.server.deps import ServiceDep
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


@router.post("/save_weights")
async def save_weights(body: SaveWeightsRequest, svc: ServiceDep) -> dict[str, Any]:
    return await handlers.save_weights(svc, body)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    body: SaveWeightsForSamplerRequest, svc: ServiceDep
) -> dict[str, Any]:
    return await handlers.save_weights_for_sampler(svc, body)


@router.post("/save_weights_external")
def save_weights_external(svc: ServiceDep) -> dict[str, Any]:
    raise InvalidRequestError(
        "save_weights_external: not supported here; use save_weights_for_sampler (PEFT adapter)"
    )


@router.post("/load_weights")
async def load_weights(body: LoadWeightsRequest, svc: ServiceDep) -> dict[str, Any]:
    return await handlers.load_weights(svc, body)


@router.post("/weights_info")
async def weights_info(body: WeightsInfoRequest, svc: ServiceDep) -> WeightsInfoResponse:
    ckpt = await svc.checkpoint(body.tinker_path, "tinker_path")
    lora = ckpt.lora_config
    return WeightsInfoResponse(
        base_model=ckpt.base_model,
        is_lora=True,
        lora_rank=lora.get("rank"),
        train_unembed=lora.get("train_unembed"),
        train_mlp=lora.get("train_mlp"),
        train_attn=lora.get("train_attn"),
    )


def checkpoint_view(row: CheckpointRow) -> Checkpoint:
    segment = "weights" if row.checkpoint_type == "training" else "sampler_weights"
    return Checkpoint(
        checkpoint_id=f"{segment}/{row.name}",
        checkpoint_type=row.checkpoint_type,
        time=row.created_at.isoformat(),
        tinker_path=row.tinker_path,
        size_bytes=row.size_bytes,
        user_metadata=row.user_metadata,
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


@router.get("/training_runs")
def list_training_runs(svc: ServiceDep, limit: int = 20, offset: int = 0) -> TrainingRunsResponse:
    stmt = select(ModelRow).order_by(ModelRow.created_at.desc())
    rows = svc.store.query(stmt.offset(offset).limit(limit))
    return TrainingRunsResponse(
        training_runs=[run_view(svc, r) for r in rows],
        cursor=Cursor(offset=offset, limit=limit, total_count=svc.store.count(stmt)),
    )


@router.get("/training_runs/{run_id}")
def get_training_run(run_id: str, svc: ServiceDep) -> TrainingRun:
    """run_id: a training run id, or a model id (the Tinker SDK passes either)."""
    return run_view(svc, svc.find_run(run_id))


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, svc: ServiceDep) -> CheckpointsListResponse:
    run = svc.find_run(run_id)
    rows = svc.store.query(
        select(CheckpointRow)
        .where(CheckpointRow.run_id == run.run_id)
        .order_by(CheckpointRow.created_at.desc())
    )
    return CheckpointsListResponse(checkpoints=[checkpoint_view(r) for r in rows])


@router.get("/checkpoints")
def list_checkpoints(svc: ServiceDep, limit: int = 100, offset: int = 0) -> CheckpointsListResponse:
    stmt = select(CheckpointRow).order_by(CheckpointRow.created_at.desc())
    rows = svc.store.query(stmt.offset(offset).limit(limit))
    return CheckpointsListResponse(
        checkpoints=[checkpoint_view(r) for r in rows],
        cursor=Cursor(offset=offset, limit=limit, total_count=svc.store.count(stmt)),
    )
