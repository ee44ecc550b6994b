"""Checkpoints on the Tinker protocol: save_state, save_weights_for_sampler,
save_weights_external, load_weights and weights_info. Listings, deletion and file download
are in treadle.server.api.tinker.runs.
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from treadle.server.api.deps import KeyDep, StateDep, TenantDep
from treadle.server.api.tinker import handlers
from treadle.server.core.state import ServerState
from treadle.server.registry import names, sources, versions
from treadle.wire.requests import (
    Int64,
    LoadWeightsRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    SeqId,
    WeightsInfoRequest,
    WeightsInfoResponse,
)

router = APIRouter(prefix="/api/v1")


async def fetch_source(
    state: ServerState, tenant_id: str, path: str, key: bytes | None, optimizer: bool
) -> sources.LoadSource | None:
    """registry load_source off the event loop (it may download and decrypt) with the
    request's key; None for a plain tinker:// checkpoint on this server's disk."""
    root = sources.packages_root(state.config)
    return await asyncio.to_thread(
        sources.load_source, state.store, root, tenant_id, path, key, optimizer
    )


# ---- saves and loads ----
@router.post("/save_weights")
async def save_weights(
    body: SaveWeightsRequest, state: StateDep, tenant: TenantDep, key: KeyDep
) -> dict:
    return await handlers.save_weights(state, tenant, body, key)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    body: SaveWeightsForSamplerRequest, state: StateDep, tenant: TenantDep, key: KeyDep
) -> dict[str, Any]:
    return await handlers.save_weights_for_sampler(state, tenant, body, key)


class SaveWeightsExternalRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    model_id: str
    path: str
    seq_id: SeqId | None = None
    ttl_seconds: Int64 | None = None
    age_encryption_recipients: list[str] | None = None
    type: Literal["save_weights_external"] = "save_weights_external"


@router.post("/save_weights_external")
async def save_weights_external(
    body: SaveWeightsExternalRequest, state: StateDep, tenant: TenantDep, key: KeyDep
) -> dict[str, Any]:
    """The PEFT adapter, as tinker://<run>/external_weights/<name>, for file download; with
    age_encryption_recipients every file is stored as <name>.age, encrypted to them."""
    as_sampler = SaveWeightsForSamplerRequest(
        model_id=body.model_id, path=body.path, seq_id=body.seq_id, ttl_seconds=body.ttl_seconds
    )
    return await handlers.save_weights_for_sampler(
        state,
        tenant,
        as_sampler,
        key,
        checkpoint_type="external",
        age_recipients=body.age_encryption_recipients,
    )


@router.post("/load_weights")
async def load_weights(
    body: LoadWeightsRequest, state: StateDep, tenant: TenantDep, key: KeyDep
) -> dict[str, Any]:
    """`path`: a tinker:// checkpoint, or a model package version GROUP:N / GROUP:latest."""
    source = await fetch_source(state, tenant.tenant_id, body.path, key, body.optimizer)
    try:
        return await handlers.load_weights(state, tenant, body, source=source)
    except BaseException:
        if source is not None and source.cleanup:
            shutil.rmtree(source.dir, ignore_errors=True)
        raise


@router.post("/weights_info")
async def weights_info(
    body: WeightsInfoRequest, state: StateDep, tenant: TenantDep
) -> WeightsInfoResponse:
    """A tinker:// checkpoint or a version reference → what loading it needs."""
    if names.is_ref(body.tinker_path):
        v = versions.get_version(state.store, tenant.tenant_id, body.tinker_path)
        base_model, lora = v.base_model, v.lora_config or {}
        is_lora = v.kind != "merged"
    else:
        ckpt = await state.checkpoints.get(body.tinker_path, "tinker_path")
        base_model, lora, is_lora = ckpt.base_model, ckpt.lora_config, True
    return WeightsInfoResponse(
        base_model=base_model,
        is_lora=is_lora,
        lora_rank=lora.get("rank"),
        train_unembed=lora.get("train_unembed"),
        train_mlp=lora.get("train_mlp"),
        train_attn=lora.get("train_attn"),
    )
