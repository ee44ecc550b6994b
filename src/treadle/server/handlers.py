"""What each submitting endpoint does: validate at the edge, build the op, file the future.

Each returns the submit reply (`UntypedAPIFuture` fields) for its route to send. They run on
the event loop: their checks read memory only, and filing a future awaits its commit.
"""

from __future__ import annotations

import asyncio
from typing import Any

from treadle.errors import InvalidRequestError, NotFoundError
from treadle.server import artifacts, encryption, registry
from treadle.server.db import new_id
from treadle.server.service import Service, SessionGoneError, sample_sequence_id
from treadle.server.validation import check_train_request, to_engine_sample_request
from treadle.types import LoraConfig
from treadle.wire import codec
from treadle.wire.requests import (
    CreateModelRequest,
    LoadWeightsRequest,
    OptimStepRequest,
    SampleRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
)


def _future(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id}


def _check_optimizer(cfg: Any, field: str) -> None:
    if cfg is not None and cfg.type != "adamw":
        raise InvalidRequestError(f"{field}.type: only 'adamw' is supported, got {cfg.type!r}")


async def create_model(svc: Service, body: CreateModelRequest) -> dict[str, Any]:
    svc.require_session(body.session_id)
    base = svc.require_base_model(body.base_model)
    _check_optimizer(body.optimizer_config, "optimizer_config")
    lora = body.lora_config or LoraConfig()
    if lora.rank < 1:
        raise InvalidRequestError(f"lora_config.rank: expected >= 1, got {lora.rank}")
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise InvalidRequestError(
            "lora_config: at least one of train_attn/mlp/unembed must be true"
        )
    registry.check_binding(body.model_package_group, body.output_path)
    model_id = await svc.new_model(
        body.session_id, body.model_seq_id, base, lora.model_dump(), body.user_metadata
    )
    await _bind(svc, model_id, body.model_package_group, body.output_path)
    rid = await svc.submit(
        svc.workers[base],
        "create",
        {"lora": lora},
        session_id=body.session_id,
        model_id=model_id,
        seq_id=0,
    )
    return _future(rid, model_id)


async def forward_backward(svc: Service, body: bytes) -> dict[str, Any]:
    model_id, seq_id, data, loss_fn, config, forward_only = codec.decode_forward_backward_request(
        body
    )
    row = svc.require_model(model_id)
    vocab, max_len = svc.engine_facts(row.base_model)
    async with svc.skip_on_error(row, seq_id):
        numeric = check_train_request(data, loss_fn, config, vocab, max_len)
    payload = {"data": data, "loss_fn": loss_fn, "loss_fn_config": numeric}
    kind = "forward" if forward_only else "forward_backward"
    rid = await svc.submit(
        svc.workers[row.base_model],
        kind,
        payload,
        session_id=row.session_id,
        model_id=model_id,
        seq_id=seq_id,
    )
    return _future(rid, model_id)


async def optim_step(svc: Service, body: OptimStepRequest) -> dict[str, Any]:
    row = svc.require_model(body.model_id)
    async with svc.skip_on_error(row, body.seq_id):
        _check_adam(body)
    rid = await svc.submit(
        svc.workers[row.base_model],
        "optim_step",
        body.adam_params,
        session_id=row.session_id,
        model_id=body.model_id,
        seq_id=body.seq_id,
    )
    return _future(rid, body.model_id)


def _check_adam(body: OptimStepRequest) -> None:
    if body.adam_params is None:
        kind = (body.optimizer_params or {}).get("type")
        raise InvalidRequestError(f"adam_params: required (optimizer {kind!r} is not supported)")
    p = body.adam_params
    if p.learning_rate < 0 or not 0 <= p.beta1 < 1 or not 0 <= p.beta2 < 1 or p.eps <= 0:
        raise InvalidRequestError(
            f"adam_params: need learning_rate >= 0, 0 <= beta1, beta2 < 1 and eps > 0, got {p}"
        )


async def _bind(svc: Service, model_id: str, group: str | None, output_path: str | None) -> None:
    """Bind a new model to its model package group: its saves become versions there."""
    if group is None:
        return
    tenant_id = getattr(svc.models.get(model_id), "tenant_id", None) or "default"
    await asyncio.to_thread(registry.bind_model, svc.store, model_id, tenant_id, group, output_path)


def _package(svc: Service, row: Any, key: bytes | None, stored: bool = True) -> dict | None:
    """What a save publishes to (None: the model has no group). A key sent for a save that
    would store plain files is refused; an in-memory snapshot (stored=False) stores none."""
    root = registry.packages_root(svc.config)
    pkg = registry.package_of(svc.store, row, key, root)
    if pkg is None and key is not None and stored:
        raise InvalidRequestError(
            "X-Treadle-Encryption-Key: encryption applies to model package versions; create "
            "the training client with model_package_group to store encrypted versions"
        )
    return pkg


def _ckpt_payload(row: Any, name: str, user_metadata: dict | None, **extra: Any) -> dict:
    return {
        "name": name,
        "run_id": row.run_id,
        "base_model": row.base_model,
        "lora_config": row.lora_config,
        "user_metadata": user_metadata,
        "tenant_id": row.tenant_id,
        **extra,
    }


async def save_weights(
    svc: Service, body: SaveWeightsRequest, key: bytes | None = None
) -> dict[str, Any]:
    row = svc.require_model(body.model_id)
    async with svc.skip_on_error(row, body.seq_id):
        name = artifacts.check_name(body.path)
        package = _package(svc, row, key)
    payload = _ckpt_payload(
        row, name, body.user_metadata, overwrite=body.overwrite, package=package
    )
    rid = await svc.submit(
        svc.workers[row.base_model],
        "save_state",
        payload,
        session_id=row.session_id,
        model_id=body.model_id,
        seq_id=body.seq_id,
    )
    return _future(rid, body.model_id)


async def save_weights_for_sampler(
    svc: Service,
    body: SaveWeightsForSamplerRequest,
    key: bytes | None = None,
    checkpoint_type: str = "sampler",
    age_recipients: list[str] | None = None,
) -> dict[str, Any]:
    """checkpoint_type "external": save_weights_external (the same PEFT adapter, under
    tinker://<run>/external_weights/<name>, downloadable file by file)."""
    row = svc.require_model(body.model_id)
    worker = svc.workers[row.base_model]
    if body.path is not None:
        async with svc.skip_on_error(row, body.seq_id):
            name = artifacts.check_name(body.path)
            package = _package(svc, row, key)
            if age_recipients is not None:
                encryption.age_recipients(age_recipients)
            if body.merge_weights and package is None:
                raise InvalidRequestError(
                    "merge_weights: a merged model is published as a version of the session's "
                    "model package group; create the training client with model_package_group"
                )
        payload = _ckpt_payload(
            row,
            name,
            body.user_metadata,
            package=package,
            merge_weights=body.merge_weights,
            checkpoint_type=checkpoint_type,
            age_recipients=age_recipients,
        )
        kind = "save_sampler"
    else:
        if body.sampling_session_seq_id is None:
            raise InvalidRequestError(
                "save_weights_for_sampler: send path or sampling_session_seq_id"
            )
        async with svc.skip_on_error(row, body.seq_id):
            package = _package(svc, row, key, stored=False)
        payload = {
            "sampling_session_id": new_id(),
            "sampling_session_seq_id": body.sampling_session_seq_id,
            "session_id": row.session_id,
            "base_model": row.base_model,
            "package": package,
            "tenant_id": row.tenant_id,
        }
        kind = "snapshot"
    rid = await svc.submit(
        worker, kind, payload, session_id=row.session_id, model_id=body.model_id, seq_id=body.seq_id
    )
    return _future(rid, body.model_id)


async def load_weights(
    svc: Service, body: LoadWeightsRequest, source: registry.LoadSource | None = None
) -> dict[str, Any]:
    """Legacy form (model_id + seq_id) loads into an existing model; create-via-load
    (session_id + model_seq_id) makes model "<session_id>:train:<model_seq_id>" from it.
    `source`: a model package version already fetched (registry.load_source)."""
    ckpt = source if source is not None else await svc.checkpoint(body.path)
    _check_optimizer(body.optimizer_config, "optimizer_config")
    if body.optimizer and ckpt.checkpoint_type != "training":
        raise InvalidRequestError(
            f"optimizer: {body.path} holds sampler weights only; optimizer state lives in "
            "tinker://<run>/weights/<name> checkpoints"
        )
    payload = {
        "dir": ckpt.dir,
        "checkpoint_type": ckpt.checkpoint_type,
        "optimizer": body.optimizer,
        "path": body.path,
        "cleanup": source is not None and source.cleanup,
    }
    if body.session_id is not None:
        if body.model_seq_id is None:
            raise InvalidRequestError("model_seq_id: required with session_id (create-via-load)")
        svc.require_session(body.session_id)
        if body.base_model is not None and body.base_model != ckpt.base_model:
            raise InvalidRequestError(
                f"base_model: {body.base_model!r} does not match the checkpoint's {ckpt.base_model!r}"
            )
        base = svc.require_base_model(ckpt.base_model)
        registry.check_binding(body.model_package_group, body.output_path)
        model_id = await svc.new_model(
            body.session_id, body.model_seq_id, base, ckpt.lora_config, body.user_metadata
        )
        await _bind(svc, model_id, body.model_package_group, body.output_path)
        session_id, seq_id = body.session_id, 0
    elif body.model_id is not None:
        row = svc.require_model(body.model_id)
        if row.base_model != ckpt.base_model:
            raise InvalidRequestError(
                f"path: checkpoint of {ckpt.base_model!r} cannot load into a {row.base_model!r} model"
            )
        model_id, session_id, seq_id, base = (
            body.model_id,
            row.session_id,
            body.seq_id,
            row.base_model,
        )
    else:
        raise InvalidRequestError(
            "load_weights: send model_id + seq_id or session_id + model_seq_id"
        )
    rid = await svc.submit(
        svc.workers[base], "load", payload, session_id=session_id, model_id=model_id, seq_id=seq_id
    )
    return _future(rid, model_id)


async def asample(svc: Service, body: SampleRequest) -> dict[str, Any]:
    if body.sampling_session_id is None:
        raise InvalidRequestError(
            "sampling_session_id: required (create one with create_sampling_session)"
        )
    sampler = await svc.sampler(body.sampling_session_id)
    try:
        svc.require_session(sampler.session_id)
    except SessionGoneError as e:
        # 404, not 410: the tinker sampler retries a 410 for hours
        raise NotFoundError(str(e)) from e
    ex = svc.executors[sampler.base_model]
    if sampler.engine_ref is not None and sampler.engine_ref not in ex.live_refs:
        raise NotFoundError(
            f"sampling_session_id {body.sampling_session_id!r}: its weights were freed from "
            "memory (too many newer samplers of the same model); save a new sampler"
        )
    vocab, max_len = svc.engine_facts(sampler.base_model)
    if body.sampling_params.max_tokens is None:  # under the input limits, if any
        default = svc.default_max_tokens(sampler.base_model, body.prompt.length)
        body.sampling_params.max_tokens = default
    request = to_engine_sample_request(body, sampler.engine_ref, vocab, max_len)
    payload = {"request": request, "prompt_logprobs_last_n": body.prompt_logprobs_last_n}
    rid = await svc.submit(
        svc.workers[sampler.base_model],
        "sample",
        payload,
        session_id=sampler.session_id,
        seq_id=body.seq_id,
        sampling_session_id=body.sampling_session_id,
    )
    ids = [sample_sequence_id(rid, i) for i in range(body.num_samples)]
    return {"request_id": rid, "sample_sequence_ids": ids}
