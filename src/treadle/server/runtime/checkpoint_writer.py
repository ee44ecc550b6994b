"""Checkpoint writing on the engine thread: save_state, sampler saves and snapshots.

A checkpoint folder is written atomically (a temp folder renamed into place), then, for a
model bound to a model package group, published as a version (treadle.server.registry),
then recorded as a checkpoints row through the journal, committed before the op's outcome
(which follows it through the same journal): a client never learns of a checkpoint that is
not there, and a failed store registers nothing.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, select, update

from treadle.errors import ConflictError
from treadle.server.registry import versions
from treadle.server.runtime.journal import Journal
from treadle.server.runtime.ops import (
    CheckpointInfo,
    PackageTarget,
    SaveResult,
    SaveSampler,
    SaveState,
    Snapshot,
)
from treadle.server.storage import artifacts, encryption
from treadle.server.storage.database import Store
from treadle.server.storage.queries import insert_row, insert_sampler_once
from treadle.server.storage.rows import CheckpointRow, utcnow


class CheckpointWriter:
    def __init__(self, engine: Any, store: Store, journal: Journal, artifacts_root: Path):
        self.engine = engine
        self.store = store
        self.journal = journal
        self.root = artifacts_root

    def save_state(self, model_id: str, p: SaveState) -> SaveResult:
        final = artifacts.checkpoint_dir(self.root, p.ckpt.run_id, "training", p.ckpt.name)
        path = artifacts.tinker_path(p.ckpt.run_id, "training", p.ckpt.name)
        if final.exists() and not p.overwrite:
            raise ConflictError(
                f"path: checkpoint {path} already exists; pass overwrite=True to replace it"
            )
        with artifacts.atomic_dir(final) as tmp:
            self.engine.save_state(model_id, tmp)
        step = self._step(model_id, p.package)
        found = self._publish(p.package, "state", final, path, step, p.ckpt)
        self._record_checkpoint(model_id, p.ckpt, "training", final, path)
        return SaveResult(path, "save_weights", found)

    def save_sampler(
        self, request_id: str, model_id: str, p: SaveSampler
    ) -> Callable[[], SaveResult]:
        """Freeze the weights now; → the write, to run later (at an idle moment)."""
        snap = f"ckpt:{request_id}"
        self.engine.snapshot(model_id, snap)
        final = artifacts.checkpoint_dir(self.root, p.ckpt.run_id, p.checkpoint_type, p.ckpt.name)
        path = artifacts.tinker_path(p.ckpt.run_id, p.checkpoint_type, p.ckpt.name)
        step = self._step(model_id, p.package)

        def write() -> SaveResult:
            merged = final.parent / f".merged-{final.name}-{uuid.uuid4().hex[:8]}"
            try:
                with artifacts.atomic_dir(final) as tmp:
                    self.engine.save_adapter(snap, tmp)
                    if p.age_recipients:  # save_weights_external, encrypted to them
                        encryption.age_encrypt_folder(tmp, p.age_recipients)
                if p.merge_weights:
                    self.engine.save_merged(snap, merged)
            finally:
                self.engine.drop_snapshot(snap)
            try:
                found = self._publish(p.package, "sampler", final, path, step, p.ckpt)
                if p.merge_weights:
                    more = self._publish(p.package, "merged", merged, None, step, p.ckpt, False)
                    found = (found or []) + (more or [])
            finally:
                shutil.rmtree(merged, ignore_errors=True)
            self._record_checkpoint(model_id, p.ckpt, p.checkpoint_type, final, path)
            external = p.checkpoint_type == "external"
            kind = "save_weights_external" if external else "save_weights_for_sampler"
            return SaveResult(path, kind, found)

        return write

    def snapshot(self, model_id: str, snap: str, p: Snapshot) -> SaveResult:
        """Freeze the weights as sampler `snap` (memory only) and record its sampling
        session; with a group, the per-step refresh is a version too."""
        self.engine.snapshot(model_id, snap)
        found = None
        if p.package is not None:
            folder = self.root / ".refresh" / uuid.uuid4().hex
            try:
                self.engine.save_adapter(snap, folder)
                step = self._step(model_id, p.package)
                found = self._publish(p.package, "sampler", folder, None, step, None)
            except BaseException:
                self.engine.drop_snapshot(snap)
                raise
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        values = {
            "sampling_session_id": p.sampling_session_id,
            "session_id": p.session_id,
            "seq_id": p.sampling_session_seq_id,
            "base_model": p.base_model,
            "model_id": model_id,
            "engine_ref": snap,
            "tenant_id": p.tenant_id,
        }
        self.journal.call(lambda conn: insert_sampler_once(conn, values))
        return SaveResult(
            None, "save_weights_for_sampler", found, sampling_session_id=p.sampling_session_id
        )

    def _step(self, model_id: str, package: PackageTarget | None) -> int | None:
        return None if package is None else int(self.engine.adapter_step(model_id))

    def _publish(
        self,
        package: PackageTarget | None,
        kind: str,
        folder: Path,
        path: str | None,
        step: int | None,
        ckpt: CheckpointInfo | None,
        keep: bool = True,
    ) -> list[str] | None:
        """Register a version of the model's package group (if it has one) from folder.

        A failed store registers nothing and fails the op; the local folder goes too, so
        that no checkpoint remains that the client was not told of. With an encryption key,
        only the ciphertext in the store remains: the plain folder is deleted.
        """
        if package is None:
            return None
        try:
            row = versions.publish(
                self.store,
                package,
                kind,
                folder,
                name=ckpt.name if ckpt else None,
                tinker_path=path,
                step=step,
                user_metadata=ckpt.user_metadata if ckpt else None,
            )
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if keep and package.key is not None:
            shutil.rmtree(folder, ignore_errors=True)
        return [f"{row.group_name}:{row.version}"]

    def _record_checkpoint(
        self, model_id: str, ckpt: CheckpointInfo, ckpt_type: str, final: Path, path: str
    ) -> None:
        values = {
            "tinker_path": path,
            "run_id": ckpt.run_id,
            "model_id": model_id,
            "checkpoint_type": ckpt_type,
            "name": ckpt.name,
            "dir": str(final),
            "base_model": ckpt.base_model,
            "lora_config": ckpt.lora_config,
            "size_bytes": artifacts.dir_size(final),
            "user_metadata": ckpt.user_metadata,
            "tenant_id": ckpt.tenant_id,
            "created_at": utcnow(),
        }

        def write(conn: Connection) -> None:
            table = CheckpointRow.__table__
            where = table.c.tinker_path == path
            if conn.execute(select(table.c.tinker_path).where(where)).first() is None:
                insert_row(conn, CheckpointRow, values)
                return
            changed = ("dir", "size_bytes", "user_metadata", "created_at")
            conn.execute(update(table).where(where).values({k: values[k] for k in changed}))

        self.journal.call(write)
