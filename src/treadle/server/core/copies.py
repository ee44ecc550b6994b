"""Runs that hold weights and cannot be trained: copies (copy_weights) and external-weights
uploads (treadle.server.core.uploads) each get a training run of their own, whose one
checkpoint is the copy or the upload.

copy_weights: a checkpoint the caller may read (its own, or one another tenant published)
becomes a new checkpoint of the caller's, of the same kind and name, in a new run: in the
session and model slot the request names (`<session>:train:<model_seq_id>`), else in the
project it names. The files are hard links of the source's where the file system allows
(no bytes duplicated; deleting or expiring either leaves the other whole), copies
elsewhere. The copy can be sampled from, loaded into a new training client, downloaded,
published, given a TTL; the run itself is unloaded ("cannot be trained on").
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from treadle.artifacts import folders as artifacts
from treadle.errors import ConflictError, InvalidRequestError
from treadle.server.core import lifetime
from treadle.server.core.state import ServerState
from treadle.server.storage.rows import CheckpointRow, ModelRow, new_id, utcnow
from treadle.server.tenancy.auth import Tenant
from treadle.wire.sdk_requests import CopyWeightsRequest

COPY_REASON = "a copy of {source} (copy_weights): load it into a new training client to train"


async def copy_weights(state: ServerState, tenant: Tenant, body: CopyWeightsRequest) -> str:
    """→ the copy's tinker:// path."""
    if body.weights_access_token is not None:
        raise InvalidRequestError(
            "weights_access_token: not used by this server; a checkpoint's owner shares it "
            "by publishing it (POST .../checkpoints/{id}/publish), then anyone copies it"
        )
    src = await state.checkpoints.get(body.source_path, "source_path")
    await lifetime.check_quota(state.store, state.admission, tenant)
    if body.session_id is not None:
        if body.model_seq_id is None:
            raise InvalidRequestError("model_seq_id: required with session_id")
        state.sessions.require(body.session_id)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
    elif body.destination_project_id is None:
        raise InvalidRequestError("destination_project_id: required without session_id")
    run_id = new_id()
    model_id = model_id if body.session_id is not None else f"{run_id}:copy"
    values = {
        "model_id": model_id,
        "run_id": run_id,
        "session_id": body.session_id or "",
        "tenant_id": tenant.tenant_id,
        "base_model": src.base_model,
        "lora_config": src.lora_config,
        "status": "unloaded",
        "unloaded_reason": COPY_REASON.format(source=src.tinker_path),
        "project_id": None if body.session_id is not None else body.destination_project_id,
    }
    folder = artifacts.checkpoint_dir(
        state.config.artifacts_dir, run_id, src.checkpoint_type, src.name
    )
    path = artifacts.tinker_path(run_id, src.checkpoint_type, src.name)
    await asyncio.to_thread(link_tree, Path(src.dir), folder)
    checkpoint = {
        "tinker_path": path,
        "run_id": run_id,
        "tenant_id": tenant.tenant_id,
        "model_id": model_id,
        "checkpoint_type": src.checkpoint_type,
        "name": src.name,
        "dir": str(folder),
        "base_model": src.base_model,
        "lora_config": src.lora_config,
        "size_bytes": src.size_bytes,
        "user_metadata": src.user_metadata,
        "expires_at": lifetime.expires_at(body.ttl_seconds),
    }
    try:
        await asyncio.to_thread(add_run, state, values, checkpoint)
    except BaseException:
        shutil.rmtree(folder.parent.parent, ignore_errors=True)
        raise
    return path


def link_tree(src: Path, dest: Path) -> None:
    """dest: the files of src, hard-linked (copied across file systems), made atomically."""
    if not src.is_dir():
        raise InvalidRequestError(f"source_path: the checkpoint's files are not at {src}")
    with artifacts.atomic_dir(dest) as tmp:
        for f in sorted(p for p in src.rglob("*") if p.is_file()):
            target = tmp / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, target)
            except OSError:
                shutil.copy2(f, target)


def add_run(state: ServerState, model: dict[str, Any], checkpoint: dict[str, Any]) -> None:
    """A run that holds one checkpoint (a copy, an upload), rows committed together."""
    now = utcnow()
    taken = ConflictError(
        f"model_seq_id: {model['model_id']!r} exists already; use a new model_seq_id"
    )
    try:
        with state.store.session.begin() as s:
            if s.scalar(select(ModelRow.model_id).where(ModelRow.model_id == model["model_id"])):
                raise taken
            s.add(ModelRow(**model, created_at=now, last_request_time=now))
            s.add(CheckpointRow(**checkpoint, created_at=now))
    except IntegrityError as e:
        raise taken from e
