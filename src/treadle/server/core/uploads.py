"""External-weights uploads: a PEFT adapter made elsewhere, sent file by file through signed
URLs, becomes a checkpoint tinker://<run>/external_weights/<name> of a run of its own
(treadle.server.core.copies), which the tenant samples from or loads into a training client.

1. `start`: the files it will send (names of a PEFT adapter folder's files, sizes within
   the import limit) → one signed URL per file, valid for upload_url_ttl_s;
2. PUT each file to its URL (`receive`): the signature is the grant, each URL takes one
   body (a second PUT is refused), of exactly the declared size, written to the upload's
   own folder under the server's data folder (its name is the server's, never the client's);
3. `finish`: every file is in, the folder is a loadable PEFT adapter of the base model
   (the checks of treadle.server.registry.imports, and the engine loads it as a dry run):
   it moves into place as the checkpoint, and its rows are written.
A refusal at any step leaves nothing behind; an upload never finished is removed once its
URLs expire (`sweep`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from sqlalchemy import update

from treadle.artifacts import folders as artifacts
from treadle.errors import ConflictError, InvalidRequestError, NotFoundError
from treadle.server.core import lifetime
from treadle.server.core.copies import add_run
from treadle.server.core.state import ServerState
from treadle.server.registry import imports
from treadle.server.storage.rows import UploadRow, new_id, utcnow
from treadle.server.tenancy.auth import Tenant, owns
from treadle.wire.sdk_requests import (
    ExternalWeightsUploadFinishResponse,
    ExternalWeightsUploadStartRequest,
    ExternalWeightsUploadStartResponse,
)

UPLOADS = "uploads"  # under data_dir: one folder per upload in progress
UPLOAD_REASON = "an uploaded adapter ({name}): load it into a new training client to train"


def _folder(state: ServerState, upload_id: str) -> Path:
    return Path(state.config.data_dir).resolve() / UPLOADS / upload_id


async def start(
    state: ServerState, tenant: Tenant, body: ExternalWeightsUploadStartRequest, base_url: str
) -> ExternalWeightsUploadStartResponse:
    engine = state.engines.require(body.base_model)
    name = artifacts.check_name(body.name, "name")
    for file in body.files:
        if file not in imports.ADAPTER_FILES:
            raise InvalidRequestError(
                f"files: {file!r} is not a file of a PEFT adapter folder; expected some of "
                f"{list(imports.ADAPTER_FILES)}"
            )
    for needed in (imports.ADAPTER_CONFIG, imports.ADAPTER_WEIGHTS):
        if needed not in body.files:
            raise InvalidRequestError(f"files: a PEFT adapter needs {needed!r}")
    limit = state.config.limits.max_import_bytes
    if sum(body.files.values()) > limit:
        raise InvalidRequestError(
            f"files: {sum(body.files.values())} bytes in all exceed the import limit {limit}"
        )
    await lifetime.check_quota(state.store, state.admission, tenant)
    upload_id = new_id()
    expires = utcnow() + dt.timedelta(seconds=state.config.upload_url_ttl_s)
    row = {
        "upload_id": upload_id,
        "tenant_id": tenant.tenant_id,
        "run_id": new_id(),
        "name": name,
        "base_model": engine.name,
        "files": {**dict(body.files), "_meta": _meta(body)},
        "received": [],
        "status": "open",
        "expires_at": expires,
        "created_at": utcnow(),
    }
    await asyncio.to_thread(_insert, state, row)
    urls = {}
    for file in body.files:
        token = state.signer.sign({"upload": upload_id, "file": file, "exp": expires.timestamp()})
        urls[file] = f"{base_url}/api/v1/treadle/uploads/{token}"
    return ExternalWeightsUploadStartResponse(upload_id=upload_id, urls=urls, expires=expires)


def _meta(body: ExternalWeightsUploadStartRequest) -> dict[str, Any]:
    return {"ttl_seconds": body.ttl_seconds, "user_metadata": body.user_metadata}


def _insert(state: ServerState, values: dict[str, Any]) -> None:
    with state.store.session.begin() as s:
        s.add(UploadRow(**values))


async def receive(state: ServerState, token: str, body: AsyncIterator[bytes]) -> dict[str, Any]:
    """One file's body, at its signed single-use URL (no API key: the signature is the
    grant)."""
    claims = state.signer.verify(token, "upload")
    upload_id, file = claims["upload"], claims["file"]
    row = await asyncio.to_thread(state.store.get, UploadRow, upload_id)
    if row is None or row.status != "open":
        raise NotFoundError(f"upload {upload_id!r} is not open")
    used = ConflictError(f"upload URL of {file!r}: used already (each URL takes one body)")
    folder = _folder(state, upload_id)
    if file in row.received or (folder / file).exists():
        raise used
    size = int(row.files[file])
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f".part-{file}-{new_id()}"
    try:
        await _read_exactly(body, part, size, file)
        try:  # the claim: a link fails if another PUT of this URL got there first
            os.link(part, folder / file)
        except FileExistsError:
            raise used from None
        await asyncio.to_thread(_received, state, upload_id, file)
    finally:
        part.unlink(missing_ok=True)
    return {"upload_id": upload_id, "file": file, "size_bytes": size}


async def _read_exactly(body: AsyncIterator[bytes], path: Path, size: int, file: str) -> None:
    received = 0
    with open(path, "wb") as f:
        async for chunk in body:
            received += len(chunk)
            if received > size:
                raise InvalidRequestError(f"{file}: more than the {size} bytes declared")
            await asyncio.to_thread(f.write, chunk)
    if received != size:
        raise InvalidRequestError(f"{file}: {received} bytes received, {size} declared")


def _received(state: ServerState, upload_id: str, file: str) -> None:
    with state.store.session.begin() as s:
        row = s.get(UploadRow, upload_id)
        if row is not None and file not in row.received:
            row.received = [*row.received, file]


async def finish(
    state: ServerState, tenant: Tenant, upload_id: str
) -> ExternalWeightsUploadFinishResponse:
    row = await asyncio.to_thread(state.store.get, UploadRow, upload_id)
    if row is None or not owns(row.tenant_id) or row.status != "open":
        raise NotFoundError(f"upload_id {upload_id!r} not found (or finished already)")
    missing = sorted(f for f in row.files if f != "_meta" and f not in row.received)
    if missing:
        raise InvalidRequestError(f"upload {upload_id!r}: files not received yet: {missing}")
    folder = _folder(state, upload_id)
    engine = state.engines.require(row.base_model)
    try:
        config = await asyncio.to_thread(imports.adapter_config, folder)
        rank = imports.check_rank(config, engine.facts.max_lora_rank, engine.name)
        await engine.call("check_adapter", directory=str(folder))  # it loads: a dry run
        await lifetime.check_quota(state.store, state.admission, tenant)
        meta = row.files["_meta"]
        final = artifacts.checkpoint_dir(
            state.config.artifacts_dir, row.run_id, "external", row.name
        )
        path = artifacts.tinker_path(row.run_id, "external", row.name)
        size = await asyncio.to_thread(_move_into_place, folder, final)
        lora = {"rank": rank, "alpha": float(config.get("lora_alpha", rank))}
        model = {
            "model_id": f"{row.run_id}:upload",
            "run_id": row.run_id,
            "session_id": "",
            "tenant_id": row.tenant_id,
            "base_model": row.base_model,
            "lora_config": lora,
            "status": "unloaded",
            "unloaded_reason": UPLOAD_REASON.format(name=row.name),
        }
        checkpoint = {
            "tinker_path": path,
            "run_id": row.run_id,
            "tenant_id": row.tenant_id,
            "model_id": model["model_id"],
            "checkpoint_type": "external",
            "name": row.name,
            "dir": str(final),
            "base_model": row.base_model,
            "lora_config": lora,
            "size_bytes": size,
            "user_metadata": meta.get("user_metadata"),
            "expires_at": lifetime.expires_at(meta.get("ttl_seconds")),
        }
        await asyncio.to_thread(add_run, state, model, checkpoint)
        await asyncio.to_thread(_finished, state, upload_id, path)
    except BaseException:
        await asyncio.to_thread(_discard, state, upload_id)
        raise
    return ExternalWeightsUploadFinishResponse(tinker_path=path, size_bytes=size)


def _move_into_place(folder: Path, final: Path) -> int:
    with artifacts.atomic_dir(final) as tmp:
        for f in folder.iterdir():
            if f.is_file() and f.name in imports.ADAPTER_FILES:
                shutil.move(str(f), tmp / f.name)
    shutil.rmtree(folder, ignore_errors=True)
    return artifacts.dir_size(final)


def _finished(state: ServerState, upload_id: str, path: str) -> None:
    with state.store.engine.begin() as conn:
        table = UploadRow.__table__
        conn.execute(
            update(table)
            .where(table.c.upload_id == upload_id)
            .values(status="finished", tinker_path=path)
        )


def _discard(state: ServerState, upload_id: str) -> None:
    """A refused upload: its files and row go (the client starts again)."""
    shutil.rmtree(_folder(state, upload_id), ignore_errors=True)
    with state.store.session.begin() as s:
        row = s.get(UploadRow, upload_id)
        if row is not None and row.status == "open":
            s.delete(row)


def sweep(state: ServerState) -> list[str]:
    """Uploads whose URLs expired unfinished: their files and rows go."""
    table = UploadRow.__table__
    with state.store.engine.connect() as conn:
        stale = [
            r
            for (r,) in conn.execute(
                table.select()
                .with_only_columns(table.c.upload_id)
                .where((table.c.status == "open") & (table.c.expires_at < utcnow()))
            )
        ]
    for upload_id in stale:
        _discard(state, upload_id)
    return stale
