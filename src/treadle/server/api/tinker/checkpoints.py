"""Model package groups and their versions: /api/v1/treadle/checkpoints/...

    GET    groups                               the tenant's groups
    GET    groups/{group}/versions?kind=        a group's versions, oldest first
    PUT    groups/{group}/retention             {keep_last, state_ttl_s}; → versions deleted
    POST   groups/{group}/import?base_model=    a tar of a PEFT adapter folder → a version
    GET    versions/{ref}                       one version (ref: GROUP:N or GROUP:latest)
    GET    versions/{ref}/resolve               {"path"}: the tinker:// path to sample from
    DELETE versions/{ref}
    GET    versions/{ref}/archive               a tar of the version's files (decrypted)

Everything is scoped by the request's tenant: another tenant's group is a 404. Requests
that read or write encrypted versions carry the key in X-Treadle-Encryption-Key.
"""

from __future__ import annotations

import asyncio
import shutil
import tarfile
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field
from starlette.background import BackgroundTask

from treadle.protocol.ops import PackageTarget
from treadle.server.api.deps import KeyDep, StateDep, TenantDep
from treadle.server.api.tinker.bodies import read_body_to_file
from treadle.server.registry import imports, names, sources, versions
from treadle.server.registry.bindings import check_binding
from treadle.server.tenancy.auth import DEV_TENANT

router = APIRouter(prefix="/api/v1/treadle/checkpoints")


class RetentionRequest(BaseModel):
    keep_last: int | None = Field(None, ge=1, le=2**31)
    """Sampler versions kept (of each of the kinds sampler and merged); null keeps all."""
    state_ttl_s: float | None = Field(None, gt=0, le=1e12)
    """Training-state versions older than this many seconds are deleted; null keeps them."""


@router.get("/groups")
def list_groups(state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    return {"groups": versions.list_groups(state.store, tenant.tenant_id)}


@router.get("/groups/{group}/versions")
def list_versions(
    group: str, state: StateDep, tenant: TenantDep, kind: str | None = None
) -> dict[str, Any]:
    rows = versions.list_versions(state.store, tenant.tenant_id, group, kind)
    return {"versions": [versions.version_view(r) for r in rows]}


@router.put("/groups/{group}/retention")
def set_retention(
    group: str, body: RetentionRequest, state: StateDep, tenant: TenantDep
) -> dict[str, Any]:
    deleted = versions.set_retention(
        state.store, tenant.tenant_id, group, body.keep_last, body.state_ttl_s
    )
    return {"deleted": [versions.version_view(r) for r in deleted]}


@router.get("/versions/{ref}")
def show_version(ref: str, state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    return versions.version_view(versions.get_version(state.store, tenant.tenant_id, ref))


@router.get("/versions/{ref}/resolve")
def resolve_version(ref: str, state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    """→ {"path"}: the tinker:// path to sample from (or the version's stored location)."""
    return {"path": sources.resolve_version(state.store, tenant.tenant_id, ref)}


@router.delete("/versions/{ref}")
def delete_version(ref: str, state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    return versions.version_view(versions.delete_version(state.store, tenant.tenant_id, ref))


@router.get("/versions/{ref}/archive")
async def version_archive(
    ref: str, state: StateDep, tenant: TenantDep, key: KeyDep
) -> FileResponse:
    """The version's files in an uncompressed tar (weights do not compress), decrypted
    with the request's key when the version is encrypted."""
    row = versions.get_version(state.store, tenant.tenant_id, ref)
    work = sources.cache_dir(sources.packages_root(state.config))

    def build() -> Path:
        files = work / "files"
        sources.fetch(row, files, key)
        archive = work / "version.tar"
        with tarfile.open(archive, "w") as tar:
            for path in sorted(p for p in files.rglob("*") if p.is_file()):
                tar.add(path, arcname=path.relative_to(files).as_posix())
        shutil.rmtree(files)
        return archive

    try:
        archive = await asyncio.to_thread(build)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return FileResponse(
        archive,
        media_type="application/x-tar",
        filename=f"{row.group_name}-v{row.version}.tar",
        background=BackgroundTask(shutil.rmtree, work, ignore_errors=True),
    )


@router.post("/groups/{group}/import")
async def import_adapter(
    group: str,
    state: StateDep,
    tenant: TenantDep,
    key: KeyDep,
    request: Request,
    base_model: str | None = None,
    name: str | None = None,
    output_path: str | None = None,
) -> dict[str, Any]:
    """A PEFT LoRA adapter folder made elsewhere (a tar of its files) → a sampler version
    of `group`, ready for create_training_client_from_state("GROUP:N")."""
    names.check_group(group, "group")
    check_binding(group, output_path, tenant == DEV_TENANT)  # the rule create_model applies
    root = sources.packages_root(state.config)
    work = sources.cache_dir(root)
    max_bytes = state.config.limits.max_import_bytes
    try:
        work.mkdir(parents=True)
        archive, folder = work / "upload.tar", work / "adapter"
        await read_body_to_file(request, archive, max_bytes)
        config = await asyncio.to_thread(imports.extract_adapter, archive, folder, max_bytes)
        engine = state.engines.require(base_model or config.get("base_model_name_or_path"))
        rank = imports.check_rank(config, engine.facts.max_lora_rank, engine.name)
        await engine.call("check_adapter", directory=str(folder))
        package = PackageTarget(
            tenant_id=tenant.tenant_id,
            group=group,
            output_root=output_path or str(root),
            base_model=engine.name,
            lora_config={"rank": rank, "alpha": float(config.get("lora_alpha", rank))},
            key=key,
        )
        label = name or f"import-{uuid.uuid4().hex[:8]}"
        row = await asyncio.to_thread(
            versions.publish, state.store, package, "sampler", folder, name=label,
            source=name or "upload",
        )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return versions.version_view(row)
