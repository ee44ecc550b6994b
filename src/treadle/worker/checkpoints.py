"""Checkpoint files, written on the engine thread: save_state, sampler saves and snapshots.

A checkpoint folder is written atomically (a temp folder renamed into place); for a model
bound to a model package group its files are then stored as a version (treadle.artifacts.
packages). The worker writes no database rows: a save returns, on its Outcome, what it
wrote (the checkpoint row, the versions stored, the sampling session a snapshot made), and
the API commits those with the result in one transaction (treadle.server.core.saves): a
client never learns of a checkpoint that is not there, and a failed store registers nothing.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treadle.artifacts import encryption
from treadle.artifacts import folders as artifacts
from treadle.artifacts.packages import store_version
from treadle.errors import ConflictError
from treadle.protocol.ops import (
    CheckpointInfo,
    PackageTarget,
    SaveResult,
    SaveSampler,
    SaveState,
    Snapshot,
)
from treadle.protocol.saved import CheckpointRecord, SamplerRecord, Saved


class CheckpointWriter:
    def __init__(self, engine: Any, artifacts_root: Path):
        self.engine = engine
        self.root = artifacts_root

    def save_state(self, model_id: str, p: SaveState) -> tuple[SaveResult, Saved]:
        final = artifacts.checkpoint_dir(self.root, p.ckpt.run_id, "training", p.ckpt.name)
        path = artifacts.tinker_path(p.ckpt.run_id, "training", p.ckpt.name)
        if final.exists() and not p.overwrite:
            raise ConflictError(
                f"path: checkpoint {path} already exists; pass overwrite=True to replace it"
            )
        with artifacts.atomic_dir(final) as tmp:
            self.engine.save_state(model_id, tmp)
        saved = Saved(checkpoints=[_checkpoint(model_id, p.ckpt, "training", final, path)])
        step = self._step(model_id, p.package)
        saved.versions += self._store(p.package, "state", final, path, step, p.ckpt)
        return SaveResult(path, "save_weights"), saved

    def save_sampler(
        self, request_id: str, model_id: str, p: SaveSampler
    ) -> Callable[[], tuple[SaveResult, Saved]]:
        """Freeze the weights now; → the write, to run later (at an idle moment)."""
        snap = f"ckpt:{request_id}"
        self.engine.snapshot(model_id, snap)
        final = artifacts.checkpoint_dir(self.root, p.ckpt.run_id, p.checkpoint_type, p.ckpt.name)
        path = artifacts.tinker_path(p.ckpt.run_id, p.checkpoint_type, p.ckpt.name)
        step = self._step(model_id, p.package)

        def write() -> tuple[SaveResult, Saved]:
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
            saved = Saved(
                checkpoints=[_checkpoint(model_id, p.ckpt, p.checkpoint_type, final, path)]
            )
            try:
                saved.versions += self._store(p.package, "sampler", final, path, step, p.ckpt)
                if p.merge_weights:
                    saved.versions += self._store(
                        p.package, "merged", merged, None, step, p.ckpt, keep=False
                    )
            finally:
                shutil.rmtree(merged, ignore_errors=True)
            external = p.checkpoint_type == "external"
            kind = "save_weights_external" if external else "save_weights_for_sampler"
            return SaveResult(path, kind), saved

        return write

    def snapshot(self, model_id: str, snap: str, p: Snapshot) -> tuple[SaveResult, Saved]:
        """Freeze the weights as sampler `snap` (memory only), with the sampling session it
        makes; with a group, the per-step refresh is a version too."""
        self.engine.snapshot(model_id, snap)
        saved = Saved()
        if p.package is not None:
            folder = self.root / ".refresh" / uuid.uuid4().hex
            try:
                self.engine.save_adapter(snap, folder)
                step = self._step(model_id, p.package)
                saved.versions += self._store(p.package, "sampler", folder, None, step, None)
            except BaseException:
                self.engine.drop_snapshot(snap)
                raise
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        saved.samplers.append(
            SamplerRecord(
                sampling_session_id=p.sampling_session_id,
                session_id=p.session_id,
                seq_id=p.sampling_session_seq_id,
                base_model=p.base_model,
                model_id=model_id,
                engine_ref=snap,
                tenant_id=p.tenant_id,
            )
        )
        result = SaveResult(
            None, "save_weights_for_sampler", sampling_session_id=p.sampling_session_id
        )
        return result, saved

    def _step(self, model_id: str, package: PackageTarget | None) -> int | None:
        return None if package is None else int(self.engine.adapter_step(model_id))

    def _store(
        self,
        package: PackageTarget | None,
        kind: str,
        folder: Path,
        path: str | None,
        step: int | None,
        ckpt: CheckpointInfo | None,
        keep: bool = True,
    ) -> list:
        """Store a version of the model's package group (if it has one) from folder.

        A failed store stores nothing and fails the op; the local folder goes too, so that
        no checkpoint remains that the client was not told of. With an encryption key, only
        the ciphertext in the store remains: the plain folder is deleted.
        """
        if package is None:
            return []
        try:
            record = store_version(
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
        return [record]


def _checkpoint(
    model_id: str, ckpt: CheckpointInfo, ckpt_type: str, final: Path, path: str
) -> CheckpointRecord:
    return CheckpointRecord(
        tinker_path=path,
        run_id=ckpt.run_id,
        model_id=model_id,
        checkpoint_type=ckpt_type,
        name=ckpt.name,
        dir=str(final),
        base_model=ckpt.base_model,
        lora_config=ckpt.lora_config,
        size_bytes=artifacts.dir_size(final),
        tenant_id=ckpt.tenant_id,
        user_metadata=ckpt.user_metadata,
        expires_in_s=ckpt.ttl_s,
    )
