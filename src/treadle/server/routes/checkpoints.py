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
import io
import json
import shutil
import tarfile
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from treadle.errors import InvalidRequestError
from treadle.server import registry, stores
from treadle.server.deps import ServiceDep, TenantDep
from treadle.server.routes.weights import request_key

router = APIRouter(prefix="/api/v1/treadle/checkpoints")

MAX_IMPORT_BYTES = 8 << 30


class RetentionRequest(BaseModel):
    keep_last: int | None = None
    """Sampler versions kept (of each of the kinds sampler and merged); null keeps all."""
    state_ttl_s: float | None = None
    """Training-state versions older than this many seconds are deleted; null keeps them."""


@router.get("/groups")
def list_groups(svc: ServiceDep, tenant: TenantDep) -> dict[str, Any]:
    return {"groups": registry.list_groups(svc.store, tenant.tenant_id)}


@router.get("/groups/{group}/versions")
def list_versions(
    group: str, svc: ServiceDep, tenant: TenantDep, kind: str | None = None
) -> dict[str, Any]:
    rows = registry.list_versions(svc.store, tenant.tenant_id, group, kind)
    return {"versions": [registry.version_view(r) for r in rows]}


@router.put("/groups/{group}/retention")
def set_retention(
    group: str, body: RetentionRequest, svc: ServiceDep, tenant: TenantDep
) -> dict[str, Any]:
    deleted = registry.set_retention(
        svc.store, tenant.tenant_id, group, body.keep_last, body.state_ttl_s
    )
    return {"deleted": [registry.version_view(r) for r in deleted]}


@router.get("/versions/{ref}")
def show_version(ref: str, svc: ServiceDep, tenant: TenantDep) -> dict[str, Any]:
    return registry.version_view(registry.get_version(svc.store, tenant.tenant_id, ref))


@router.get("/versions/{ref}/resolve")
def resolve_version(ref: str, svc: ServiceDep, tenant: TenantDep) -> dict[str, Any]:
    """→ {"path"}: the tinker:// path to sample from (or the version's stored location)."""
    return {"path": registry.resolve_version(svc, tenant.tenant_id, ref)}


@router.delete("/versions/{ref}")
def delete_version(ref: str, svc: ServiceDep, tenant: TenantDep) -> dict[str, Any]:
    return registry.version_view(registry.delete_version(svc.store, tenant.tenant_id, ref))


@router.get("/versions/{ref}/archive")
async def version_archive(
    ref: str, svc: ServiceDep, tenant: TenantDep, request: Request
) -> FileResponse:
    """The version's files in an uncompressed tar (weights do not compress), decrypted
    with the request's key when the version is encrypted."""
    row = registry.get_version(svc.store, tenant.tenant_id, ref)
    key = request_key(request)
    work = registry.cache_dir(registry.packages_root(svc.config))

    def build() -> Path:
        files = work / "files"
        registry.fetch(row, files, key)
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
    svc: ServiceDep,
    tenant: TenantDep,
    request: Request,
    base_model: str | None = None,
    name: str | None = None,
    output_path: str | None = None,
) -> dict[str, Any]:
    """A PEFT LoRA adapter folder made elsewhere (a tar of its files) → a sampler version
    of `group`, ready for create_training_client_from_state("GROUP:N")."""
    registry.check_group(group, "group")
    output_root = stores.check_output_path(output_path)
    body = await request.body()
    if len(body) > MAX_IMPORT_BYTES:
        raise InvalidRequestError(f"body: at most {MAX_IMPORT_BYTES} bytes, got {len(body)}")
    key = request_key(request)
    work = registry.cache_dir(registry.packages_root(svc.config))

    def run() -> Any:
        folder = work / "adapter"
        folder.mkdir(parents=True)
        try:
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                tar.extractall(folder, filter="data")
        except tarfile.TarError as e:
            raise InvalidRequestError(f"body: expected a tar of the adapter folder: {e}") from e
        config = _adapter_config(folder)
        base = base_model or config.get("base_model_name_or_path")
        svc.require_base_model(base, "base_model")
        pkg = {
            "tenant_id": tenant.tenant_id,
            "group": group,
            "output_root": output_root or str(registry.packages_root(svc.config)),
            "key": key,
            "base_model": base,
            "lora_config": {
                "rank": int(config.get("r", 8)),
                "alpha": float(config.get("lora_alpha", config.get("r", 8))),
            },
        }
        return registry.publish(
            svc.store,
            pkg,
            "sampler",
            folder,
            name=name or f"import-{uuid.uuid4().hex[:8]}",
            source=name or "upload",
        )

    try:
        row = await asyncio.to_thread(run)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return registry.version_view(row)


def _adapter_config(folder: Path) -> dict[str, Any]:
    from treadle.engine.checkpoints import ADAPTER_CONFIG, ADAPTER_WEIGHTS, _check_peft_config

    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        found = sorted(p.name for p in folder.iterdir())
        raise InvalidRequestError(
            f"body: a PEFT adapter folder holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}; "
            f"found {found}"
        )
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    _check_peft_config(config)
    return config
