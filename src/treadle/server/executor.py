"""Turns scheduled ops into Engine calls and their results into future outcomes.

Runs on the engine thread only. An outcome is a dict of RequestRow columns (status, result,
content_type, error, token counts) keyed by request_id; the worker persists it.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import Connection, select, update

from treadle.engine.types import (
    AdamSpec,
    LoraSpec,
    SampleRequest,
    SampleResult,
    TrainBatch,
    TrainDatum,
)
from treadle.errors import ConflictError, InvalidRequestError, NotFoundError, TreadleError
from treadle.server import artifacts, encryption, registry
from treadle.server.db import (
    DEFAULT_TENANT_ID,
    CheckpointRow,
    SamplingSessionRow,
    Store,
    insert_row,
    utcnow,
)
from treadle.server.journal import Journal
from treadle.server.scheduler import Deferred, Op
from treadle.types import (
    ForwardBackwardOutput,
    LoraConfig,
    SampledSequence,
    SampleResponse,
    TensorData,
)
from treadle.wire import codec

log = logging.getLogger("treadle.executor")

JSON_TYPE = "application/json"
PROTO_TYPE = "application/x-protobuf"
USER_ERRORS = (InvalidRequestError, NotFoundError, ConflictError)


def lora_spec(cfg: LoraConfig) -> LoraSpec:
    return LoraSpec(
        rank=cfg.rank,
        alpha=float(cfg.alpha) if cfg.alpha is not None else 32.0,
        seed=cfg.seed or 0,
        train_attn=cfg.train_attn,
        train_mlp=cfg.train_mlp,
        train_unembed=cfg.train_unembed,
    )


def train_tokens(op: Op) -> int:
    return sum(d.model_input.length for d in op.payload["data"])


class OpExecutor:
    def __init__(
        self,
        engine: Any,
        store: Store | None,
        artifacts_root: Path | None,
        max_snapshots: int = 8,
        journal: Journal | None = None,
    ):
        self.engine = engine
        self.store = store
        self.journal = journal
        self.root = artifacts_root
        self.max_snapshots = max_snapshots
        self.snapshots: dict[str, deque[str]] = {}  # model_id → its live snapshot ids, oldest first
        self.live_refs: set[str] = set()  # engine ids a sampling session may use

    def _write(self, write: Callable[[Connection], Any]) -> None:
        """A row this op makes, committed before the op's outcome (which follows it through
        the same journal), so a client never learns of a row that is not there."""
        if self.journal is not None:
            self.journal.call(write)
        else:
            with self.store.engine.begin() as conn:
                write(conn)

    # ---- outcomes ----
    @staticmethod
    def ok(op: Op, result: dict | bytes, **usage: int) -> dict[str, Any]:
        is_proto = isinstance(result, bytes)
        return {
            "request_id": op.request_id,
            "status": "done",
            "result": result if is_proto else json.dumps(result).encode(),
            "content_type": PROTO_TYPE if is_proto else JSON_TYPE,
            **usage,
        }

    @staticmethod
    def failure(op: Op, exc: BaseException) -> dict[str, Any]:
        category = "user" if isinstance(exc, USER_ERRORS) else "server"
        if category == "server":
            log.error("request %s (%s) failed", op.request_id, op.kind, exc_info=exc)
        message = str(exc) if isinstance(exc, TreadleError) else f"{type(exc).__name__}: {exc}"
        return {
            "request_id": op.request_id,
            "status": "failed",
            "error": {"error": message, "category": category},
        }

    # ---- training: several sessions in one engine call ----
    def run_train(self, ops: list[Op], forward_only: bool) -> list[dict[str, Any]]:
        """One engine.forward_backward for all ops; if it fails and held several ops, each
        op is retried alone so that one bad request does not fail the others."""
        try:
            results = self.engine.forward_backward([self._batch(op) for op in ops], forward_only)
        except Exception as e:
            if len(ops) == 1:
                return [self.failure(ops[0], e)]
            log.warning("mixed train batch of %d failed (%s); retrying one by one", len(ops), e)
            return [o for op in ops for o in self.run_train([op], forward_only)]
        return [self._train_outcome(op, r) for op, r in zip(ops, results, strict=True)]

    @staticmethod
    def _batch(op: Op) -> TrainBatch:
        p = op.payload
        data = [
            TrainDatum(
                tokens=np.asarray(d.model_input.to_ints(), dtype=np.int64),
                loss_inputs={k: td.to_numpy() for k, td in d.loss_fn_inputs.items()},
            )
            for d in p["data"]
        ]
        return TrainBatch(
            adapter_id=op.model_id, data=data, loss_fn=p["loss_fn"], loss_config=p["loss_fn_config"]
        )

    def _train_outcome(self, op: Op, result: Any) -> dict[str, Any]:
        out = ForwardBackwardOutput(
            loss_fn_output_type="TensorData",
            loss_fn_outputs=[
                {k: TensorData.from_numpy(np.asarray(v)) for k, v in o.items()}
                for o in result.outputs
            ],
            metrics={k: float(v) for k, v in result.metrics.items()},
        )
        return self.ok(op, codec.encode_forward_backward_output(out), train_tokens=train_tokens(op))

    # ---- sampling: all requests in one engine call ----
    def run_samples(self, ops: list[Op]) -> list[dict[str, Any]]:
        try:
            results = self.engine.sample([op.payload["request"] for op in ops])
        except Exception as e:
            if len(ops) == 1:
                return [self.failure(ops[0], e)]
            log.warning("sample batch of %d failed (%s); retrying one by one", len(ops), e)
            return [o for op in ops for o in self.run_samples([op])]
        return [self._sample_outcome(op, r) for op, r in zip(ops, results, strict=True)]

    def _sample_outcome(self, op: Op, result: SampleResult) -> dict[str, Any]:
        req: SampleRequest = op.payload["request"]
        prompt_lps = result.prompt_logprobs if req.prompt_logprobs else None
        topk = result.topk_prompt_logprobs if req.topk_prompt_logprobs > 0 else None
        last_n = op.payload.get("prompt_logprobs_last_n")
        if last_n is not None:
            cut = len(req.prompt) - last_n  # positions before the last N are not scored
            prompt_lps = [None] * cut + list(prompt_lps[cut:]) if prompt_lps else prompt_lps
            topk = [None] * cut + list(topk[cut:]) if topk else topk
        alt = result.prompt_alt_tokens
        resp = SampleResponse(
            sequences=[
                SampledSequence(
                    stop_reason=s.stop_reason,
                    tokens=s.tokens,
                    logprobs=s.logprobs,
                    topk_logprobs=s.topk,
                )
                for s in result.sequences
            ],
            prompt_logprobs=prompt_lps,
            topk_prompt_logprobs=topk,
            target_prompt_logprobs=None
            if result.target_prompt_logprobs is None
            else TensorData.from_numpy(result.target_prompt_logprobs),
            prompt_alt_tokens=None
            if alt is None
            else (TensorData.from_numpy(alt[0]), TensorData.from_numpy(alt[1])),
        )
        sampled = sum(len(s.tokens) for s in result.sequences)
        return self.ok(
            op,
            codec.encode_sample_response(resp),
            prompt_tokens=len(req.prompt),
            sampled_tokens=sampled,
        )

    # ---- everything else: one op at a time, in its model's order ----
    def run_single(self, op: Op) -> dict[str, Any] | Deferred:
        try:
            return getattr(self, f"_do_{op.kind}")(op)
        except Exception as e:
            return self.failure(op, e)

    def _do_skip(self, op: Op) -> dict[str, Any]:
        """A request refused at the API edge, holding its seq_id's place in the order."""
        return self.failure(op, InvalidRequestError(op.payload))

    def _do_create(self, op: Op) -> dict[str, Any]:
        self.engine.create_adapter(op.model_id, lora_spec(op.payload["lora"]))
        return self.ok(op, {"model_id": op.model_id, "type": "create_model"})

    def _do_load(self, op: Op) -> dict[str, Any]:
        p = op.payload
        try:
            if p["checkpoint_type"] == "training":
                self.engine.load_state(op.model_id, p["dir"], with_optimizer=p["optimizer"])
            else:
                self.engine.load_adapter(op.model_id, p["dir"])
        finally:
            if p.get("cleanup"):  # a decrypted or downloaded copy of a version
                shutil.rmtree(p["dir"], ignore_errors=True)
        return self.ok(op, {"path": p["path"], "model_id": op.model_id, "type": "load_weights"})

    def _do_optim_step(self, op: Op) -> dict[str, Any]:
        spec = AdamSpec(**op.payload.model_dump())
        metrics = self.engine.optim_step(op.model_id, spec)
        return self.ok(op, {"metrics": {k: float(v) for k, v in (metrics or {}).items()}})

    def _do_save_state(self, op: Op) -> dict[str, Any]:
        p = op.payload
        final = artifacts.checkpoint_dir(self.root, p["run_id"], "training", p["name"])
        path = artifacts.tinker_path(p["run_id"], "training", p["name"])
        if final.exists() and not p["overwrite"]:
            raise ConflictError(
                f"path: checkpoint {path} already exists; pass overwrite=True to replace it"
            )
        with artifacts.atomic_dir(final) as tmp:
            self.engine.save_state(op.model_id, tmp)
        step = self._step(op)
        versions = self._publish(op, "state", final, path, step)
        self._record_checkpoint(op, "training", final, path)
        return self.ok(op, {"path": path, "type": "save_weights", **versions})

    def _do_save_sampler(self, op: Op) -> Deferred:
        """Freeze the weights now (memory only), write them to disk at an idle moment: the
        model's next ops need not wait for the disk."""
        p = op.payload
        snap = f"ckpt:{op.request_id}"
        self.engine.snapshot(op.model_id, snap)
        ckpt_type = p.get("checkpoint_type", "sampler")
        final = artifacts.checkpoint_dir(self.root, p["run_id"], ckpt_type, p["name"])
        path = artifacts.tinker_path(p["run_id"], ckpt_type, p["name"])
        step = self._step(op)

        def write() -> dict[str, Any]:
            merged = final.parent / f".merged-{final.name}-{uuid.uuid4().hex[:8]}"
            try:
                with artifacts.atomic_dir(final) as tmp:
                    self.engine.save_adapter(snap, tmp)
                    if p.get("age_recipients"):  # save_weights_external, encrypted to them
                        encryption.age_encrypt_folder(tmp, p["age_recipients"])
                if p.get("merge_weights"):
                    self.engine.save_merged(snap, merged)
            finally:
                self.engine.drop_snapshot(snap)
            try:
                versions = self._publish(op, "sampler", final, path, step)
                if p.get("merge_weights"):
                    more = self._publish(op, "merged", merged, None, step, keep=False)
                    versions["versions"] += more["versions"]
            finally:
                shutil.rmtree(merged, ignore_errors=True)
            self._record_checkpoint(op, ckpt_type, final, path)
            external = ckpt_type == "external"
            kind = "save_weights_external" if external else "save_weights_for_sampler"
            result = {"path": path, "type": kind, **versions}
            return self.ok(op, result)

        return Deferred(op, write)

    def _step(self, op: Op) -> int | None:
        if op.payload.get("package") is None:
            return None
        return int(self.engine.adapter_step(op.model_id))

    def _publish(
        self,
        op: Op,
        kind: str,
        folder: Path,
        path: str | None,
        step: int | None,
        keep: bool = True,
    ) -> dict[str, Any]:
        """Register a version of the model's package group (if it has one) from folder.

        A failed store registers nothing and fails the op; the local folder goes too, so
        that no checkpoint remains that the client was not told of. With an encryption key,
        only the ciphertext in the store remains: the plain folder is deleted.
        """
        pkg = op.payload.get("package") if isinstance(op.payload, dict) else None
        if pkg is None:
            return {}
        try:
            row = registry.publish(
                self.store,
                pkg,
                kind,
                folder,
                name=op.payload.get("name"),
                tinker_path=path,
                step=step,
                user_metadata=op.payload.get("user_metadata"),
            )
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if keep and pkg.get("key") is not None:
            shutil.rmtree(folder, ignore_errors=True)
        return {"versions": [f"{row.group_name}:{row.version}"]}

    def _record_checkpoint(self, op: Op, ckpt_type: str, final: Path, path: str) -> None:
        p = op.payload
        values = {
            "tinker_path": path,
            "run_id": p["run_id"],
            "model_id": op.model_id,
            "checkpoint_type": ckpt_type,
            "name": p["name"],
            "dir": str(final),
            "base_model": p["base_model"],
            "lora_config": p["lora_config"],
            "size_bytes": artifacts.dir_size(final),
            "user_metadata": p.get("user_metadata"),
            "tenant_id": p.get("tenant_id", DEFAULT_TENANT_ID),
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

        self._write(write)

    def _do_snapshot(self, op: Op) -> dict[str, Any]:
        """save_weights_for_sampler without a name: a sampler served from memory at once."""
        p = op.payload
        snap = f"snap:{p['sampling_session_id']}"
        self.engine.snapshot(op.model_id, snap)
        versions: dict[str, Any] = {}
        if p.get("package") is not None:  # the per-step sampler refresh is a version too
            folder = self.root / ".refresh" / uuid.uuid4().hex
            try:
                self.engine.save_adapter(snap, folder)
                versions = self._publish(op, "sampler", folder, None, self._step(op))
            except BaseException:
                self.engine.drop_snapshot(snap)
                raise
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        self.live_refs.add(snap)
        kept = self.snapshots.setdefault(op.model_id, deque())
        kept.append(snap)
        while len(kept) > self.max_snapshots:
            self.drop_ref(kept.popleft())
        values = {
            "sampling_session_id": p["sampling_session_id"],
            "session_id": p["session_id"],
            "seq_id": p["sampling_session_seq_id"],
            "base_model": p["base_model"],
            "model_id": op.model_id,
            "engine_ref": snap,
            "tenant_id": p.get("tenant_id", DEFAULT_TENANT_ID),
        }
        self._write(lambda conn: insert_row(conn, SamplingSessionRow, values))
        result = {"path": None, "sampling_session_id": p["sampling_session_id"]}
        return self.ok(op, {**result, "type": "save_weights_for_sampler", **versions})

    # ---- control calls (engine thread, via EngineWorker.call) ----
    def load_sampler(self, ref: str, checkpoint_type: str, directory: str) -> None:
        """A sampler from a saved checkpoint: loaded as an adapter of its own."""
        if checkpoint_type == "training":
            self.engine.load_state(ref, directory, with_optimizer=False)
        else:
            self.engine.load_adapter(ref, directory)
        self.live_refs.add(ref)

    def drop_ref(self, ref: str) -> None:
        if ref not in self.live_refs:
            return
        self.live_refs.discard(ref)
        try:
            if ref.startswith("snap:"):
                self.engine.drop_snapshot(ref)
            else:
                self.engine.drop_adapter(ref)
        except Exception:
            log.exception("could not free %s", ref)

    def drop_model(self, model_id: str) -> None:
        for snap in self.snapshots.pop(model_id, deque()):
            self.drop_ref(snap)
        try:
            self.engine.drop_adapter(model_id)
        except Exception:
            log.exception("could not drop adapter %s", model_id)
