"""What a `model` name refers to, and the weights that serve it.

    base model          "treadle/tiny-llama"            the served base, no adapter
    training model      "<session_id>:train:<n>"        the session's current weights (live:
                                                        each optimizer step is seen at once)
    sampling session    "<sampling_session_id>"         the weights it was made with
    sampler checkpoint  "tinker://<run>/sampler_weights/<name>" (or weights/<name>)
    registered version  "GROUP:N" or "GROUP:latest"     through the checkpoint registry

Checkpoints are loaded into the engine as samplers of their own, kept while used (least
recently used out first). Ownership is the core components' (and the tenant's row filter):
another tenant's resource is not found.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from treadle.errors import NotFoundError, SessionGoneError
from treadle.server.core.state import ServerState
from treadle.server.registry import names, sources
from treadle.server.storage.rows import CheckpointRow, new_id

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

    def cached(self, state: ServerState, key: str) -> tuple[str, str] | None:
        found = self._refs.get(key)
        engine = state.engines.get(found[0]) if found is not None else None
        if engine is None or not engine.is_live(found[1]):
            return None
        self._refs.move_to_end(key)
        return found

    async def ref_for(
        self,
        state: ServerState,
        base: str,
        checkpoint_type: str,
        folder: str,
        key: str | None = None,
    ) -> str:
        key = key or folder
        async with self._lock:
            found = self.cached(state, key)
            if found is not None:
                return found[1]
            ref = f"openai:{new_id()}"
            await state.engines.require(base).call(
                "load_sampler", ref=ref, checkpoint_type=checkpoint_type, directory=folder
            )
            self._refs[key] = (base, ref)
            while len(self._refs) > self.max_loaded:
                _, (old_base, old_ref) = self._refs.popitem(last=False)
                await state.engines.require(old_base).call("drop_ref", ref=old_ref)
            return ref


async def resolve(
    state: ServerState,
    samplers: CheckpointSamplers,
    tenant_id: str,
    name: str,
    load: bool = True,
    key: bytes | None = None,
) -> Target:
    """The weights `name` refers to; NotFoundError (→ 404 model_not_found) if none.
    `load` False: only look it up (no checkpoint is loaded); `key`: the tenant's encryption
    key, for encrypted versions."""
    if name in state.engines:
        return Target(name, name, None)
    if name.startswith("tinker://"):
        ckpt = await state.checkpoints.get(name, "model")
        return await _checkpoint_target(state, samplers, tenant_id, name, ckpt, load)
    if names.is_ref(name):
        return await _version_target(state, samplers, tenant_id, name, load, key)
    if ":train:" in name:
        return _training_target(state, tenant_id, name)
    return await _sampler_target(state, tenant_id, name)


def _training_target(state: ServerState, tenant_id: str, name: str) -> Target:
    try:
        row = state.models.require(name, field="model")
    except SessionGoneError as e:
        raise NotFoundError(f"model: {e}") from e
    _owned(row, tenant_id, f"training model {name!r}")
    created = int(row.created_at.timestamp()) if row.created_at else 0
    return Target(name, row.base_model, name, session_id=row.session_id, created=created)


async def _sampler_target(state: ServerState, tenant_id: str, name: str) -> Target:
    try:
        row = await state.samplers.get(name)
    except NotFoundError:
        raise _not_found(name) from None
    _owned(row, tenant_id, f"sampling session {name!r}")
    try:
        row = await state.samplers.require_live(name)
    except NotFoundError as e:
        raise NotFoundError(f"model: {e}") from e
    return Target(
        name,
        row.base_model,
        row.engine_ref,
        session_id=row.session_id,
        sampling_session_id=row.sampling_session_id,
        created=int(row.created_at.timestamp()) if row.created_at else 0,
    )


async def _checkpoint_target(
    state: ServerState,
    samplers: CheckpointSamplers,
    tenant_id: str,
    name: str,
    ckpt: CheckpointRow,
    load: bool,
) -> Target:
    _owned(ckpt, tenant_id, f"checkpoint {name!r}")
    base = state.engines.require(ckpt.base_model, "model").name
    ref = await samplers.ref_for(state, base, ckpt.checkpoint_type, ckpt.dir) if load else None
    created = int(ckpt.created_at.timestamp()) if ckpt.created_at else 0
    return Target(name, base, ref, created=created)


async def _version_target(
    state: ServerState,
    samplers: CheckpointSamplers,
    tenant_id: str,
    name: str,
    load: bool,
    key: bytes | None,
) -> Target:
    """A registered version: its checkpoint when it is on this server, else its files
    fetched (S3, encrypted) into a folder once and loaded from there."""
    try:
        where = await asyncio.to_thread(sources.resolve_version, state.store, tenant_id, name)
    except NotFoundError as e:
        raise NotFoundError(f"model: {e}") from e
    if where.startswith("tinker://"):
        ckpt = await state.checkpoints.get(where, "model")
        return await _checkpoint_target(state, samplers, tenant_id, name, ckpt, load)
    found = samplers.cached(state, where)
    if found is not None:
        return Target(name, found[0], found[1])
    root = sources.packages_root(state.config)
    src = await asyncio.to_thread(
        sources.load_source, state.store, root, tenant_id, name, key, False
    )
    try:
        base = state.engines.require(src.base_model, "model").name
        ref = None
        if load:
            ref = await samplers.ref_for(state, base, src.checkpoint_type, src.dir, key=where)
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


async def list_models(state: ServerState, tenant_id: str, limit: int = 100) -> list[dict]:
    """Base models, the tenant's live training models and its newest sampler checkpoints."""
    now = int(time.time())
    out = [model_entry(name, "treadle", name, now) for name in state.engines.names()]
    for row in state.models.live(tenant_id):
        created = int(row.created_at.timestamp()) if row.created_at else now
        out.append(model_entry(row.model_id, tenant_id, row.base_model, created))
    ckpts = await asyncio.to_thread(state.checkpoints.newest_sampler_checkpoints, tenant_id, limit)
    for ckpt in ckpts:
        created = int(ckpt.created_at.timestamp()) if ckpt.created_at else now
        out.append(model_entry(ckpt.tinker_path, tenant_id, ckpt.base_model, created))
    return out
