"""What a `model` name refers to, and the weights that serve it.

    base model          "treadle/tiny-llama"            the served base, no adapter
    training model      "<session_id>:train:<n>"        the session's current weights (live:
                                                        each optimizer step is seen at once)
    sampling session    "<sampling_session_id>"         the weights it was made with
    sampler checkpoint  "tinker://<run>/sampler_weights/<name>" (or weights/<name>)
    registered version  "GROUP:N" or "GROUP:latest"     through the checkpoint registry

Checkpoints are loaded into the engine as samplers of their own, kept while used (least
recently used out first). Ownership is the Service's (and the tenant's row filter): another
tenant's resource is not found.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from treadle.errors import NotFoundError
from treadle.server.db import CheckpointRow, new_id
from treadle.server.service import Service, SessionGoneError

MAX_LOADED_CHECKPOINTS = 4


@dataclass(frozen=True)
class Target:
    """Where one request samples: a base model and the engine's adapter reference."""

    name: str
    base_model: str
    adapter: str | None  # None: the base; a live model_id; a snapshot or sampler ref
    session_id: str | None = None
    sampling_session_id: str | None = None
    created: int = 0


def _owned(row: Any, tenant_id: str, what: str) -> None:
    owner = getattr(row, "tenant_id", None)
    if owner is not None and owner != tenant_id:
        raise NotFoundError(f"model: {what} not found")


def _not_found(name: str) -> NotFoundError:
    return NotFoundError(
        f"model: {name!r} is not a served base model, a training model_id, a sampling "
        "session id, a tinker:// checkpoint path or a registered version GROUP:N; "
        "GET /v1/models lists them"
    )


class CheckpointSamplers:
    """Saved checkpoints loaded as engine samplers, least recently used first out.

    Keyed by where the files are (a checkpoint folder, or a version's location): the same
    checkpoint asked for again is served from memory, without reading or fetching it."""

    def __init__(self, max_loaded: int = MAX_LOADED_CHECKPOINTS):
        self.max_loaded = max_loaded
        self._refs: OrderedDict[str, tuple[str, str]] = OrderedDict()  # key → (base, ref)
        self._lock = asyncio.Lock()

    def cached(self, svc: Service, key: str) -> tuple[str, str] | None:
        found = self._refs.get(key)
        if found is None or found[1] not in svc.executors[found[0]].live_refs:
            return None
        self._refs.move_to_end(key)
        return found

    async def ref_for(
        self, svc: Service, base: str, checkpoint_type: str, folder: str, key: str | None = None
    ) -> str:
        key = key or folder
        async with self._lock:
            found = self.cached(svc, key)
            if found is not None:
                return found[1]
            ref = f"openai:{new_id()}"
            ex = svc.executors[base]
            await _on_engine(svc, base, lambda: ex.load_sampler(ref, checkpoint_type, folder))
            self._refs[key] = (base, ref)
            while len(self._refs) > self.max_loaded:
                _, (old_base, old_ref) = self._refs.popitem(last=False)
                drop = functools.partial(svc.executors[old_base].drop_ref, old_ref)
                await _on_engine(svc, old_base, drop)
            return ref


async def _on_engine(svc: Service, base: str, fn: Any) -> None:
    """A control call, run on the engine's own thread between its batches."""
    await asyncio.wrap_future(svc.workers[base].call(fn))


async def resolve(
    svc: Service,
    samplers: CheckpointSamplers,
    tenant_id: str,
    name: str,
    load: bool = True,
    key: bytes | None = None,
) -> Target:
    """The weights `name` refers to; NotFoundError (→ 404 model_not_found) if none.
    `load` False: only look it up (no checkpoint is loaded); `key`: the tenant's encryption
    key, for encrypted versions."""
    if name in svc.workers:
        return Target(name, name, None)
    if name.startswith("tinker://"):
        ckpt = await svc.checkpoint(name, "model")
        return await _checkpoint_target(svc, samplers, tenant_id, name, ckpt, load)
    registry = _registry()
    if registry is not None and registry.is_ref(name):
        return await _version_target(svc, samplers, registry, tenant_id, name, load, key)
    if ":train:" in name:
        return _training_target(svc, tenant_id, name)
    return await _sampler_target(svc, tenant_id, name)


def _registry() -> Any:
    try:
        from treadle.server import registry
    except ImportError:  # a server without the checkpoint registry
        return None
    return registry


def _training_target(svc: Service, tenant_id: str, name: str) -> Target:
    try:
        row = svc.require_model(name, field="model")
    except SessionGoneError as e:
        raise NotFoundError(f"model: {e}") from e
    _owned(row, tenant_id, f"training model {name!r}")
    created = int(row.created_at.timestamp()) if row.created_at else 0
    return Target(name, row.base_model, name, session_id=row.session_id, created=created)


async def _sampler_target(svc: Service, tenant_id: str, name: str) -> Target:
    try:
        row = await svc.sampler(name)
    except NotFoundError:
        raise _not_found(name) from None
    _owned(row, tenant_id, f"sampling session {name!r}")
    try:
        svc.require_session(row.session_id)
    except SessionGoneError as e:
        raise NotFoundError(f"model: {e}") from e
    ex = svc.executors.get(row.base_model)
    if ex is None or (row.engine_ref is not None and row.engine_ref not in ex.live_refs):
        raise NotFoundError(
            f"model: sampling session {name!r}: its weights were freed from memory; "
            "save a new sampler"
        )
    return Target(
        name,
        row.base_model,
        row.engine_ref,
        session_id=row.session_id,
        sampling_session_id=row.sampling_session_id,
        created=int(row.created_at.timestamp()) if row.created_at else 0,
    )


async def _checkpoint_target(
    svc: Service,
    samplers: CheckpointSamplers,
    tenant_id: str,
    name: str,
    ckpt: CheckpointRow,
    load: bool,
) -> Target:
    _owned(ckpt, tenant_id, f"checkpoint {name!r}")
    base = svc.require_base_model(ckpt.base_model, "model")
    ref = await samplers.ref_for(svc, base, ckpt.checkpoint_type, ckpt.dir) if load else None
    created = int(ckpt.created_at.timestamp()) if ckpt.created_at else 0
    return Target(name, base, ref, created=created)


async def _version_target(
    svc: Service,
    samplers: CheckpointSamplers,
    registry: Any,
    tenant_id: str,
    name: str,
    load: bool,
    key: bytes | None,
) -> Target:
    """A registered version: its checkpoint when it is on this server, else its files
    fetched (S3, encrypted) into a folder once and loaded from there."""
    try:
        where = await asyncio.to_thread(registry.resolve_version, svc, tenant_id, name)
    except NotFoundError as e:
        raise NotFoundError(f"model: {e}") from e
    if where.startswith("tinker://"):
        ckpt = await svc.checkpoint(where, "model")
        return await _checkpoint_target(svc, samplers, tenant_id, name, ckpt, load)
    found = samplers.cached(svc, where)
    if found is not None:
        return Target(name, found[0], found[1])
    root = registry.packages_root(svc.config)
    src = await asyncio.to_thread(
        registry.load_source, svc.store, root, tenant_id, name, key, False
    )
    try:
        base = svc.require_base_model(src.base_model, "model")
        ref = None
        if load:
            ref = await samplers.ref_for(svc, base, src.checkpoint_type, src.dir, key=where)
    finally:
        if src.cleanup:
            shutil.rmtree(src.dir, ignore_errors=True)
    return Target(name, base, ref)


def model_entry(model: str, owned_by: str, root: str, created: int) -> dict[str, Any]:
    """One entry of GET /v1/models; `root` is the base model (vLLM's convention)."""
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": owned_by,
        "root": root,
        "parent": None if root == model else root,
    }


async def list_models(svc: Service, tenant_id: str, limit: int = 100) -> list[dict[str, Any]]:
    """Base models, the tenant's live training models and its newest sampler checkpoints."""
    now = int(time.time())
    out = [model_entry(name, "treadle", name, now) for name in svc.workers]
    for model_id, row in list(svc.models.items()):
        if getattr(row, "tenant_id", tenant_id) != tenant_id or row.status != "active":
            continue
        worker = svc.workers.get(row.base_model)
        if row.session_id not in svc.last_seen or worker is None or not worker.has_model(model_id):
            continue
        created = int(row.created_at.timestamp()) if row.created_at else now
        out.append(model_entry(model_id, tenant_id, row.base_model, created))
    stmt = (
        select(CheckpointRow)
        .where(CheckpointRow.checkpoint_type == "sampler")
        .order_by(CheckpointRow.created_at.desc())
        .limit(limit)
    )
    if hasattr(CheckpointRow, "tenant_id"):
        stmt = stmt.where(CheckpointRow.tenant_id == tenant_id)
    for ckpt in await asyncio.to_thread(svc.store.query, stmt):
        created = int(ckpt.created_at.timestamp()) if ckpt.created_at else now
        out.append(model_entry(ckpt.tinker_path, tenant_id, ckpt.base_model, created))
    return out
