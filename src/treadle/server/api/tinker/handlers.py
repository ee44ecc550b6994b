"""What each submitting Tinker endpoint does: check at the edge, build the typed op, file it.

Each returns the submit reply (`UntypedAPIFuture` fields) for its route to send. They run
on the event loop and read memory only; filing a future awaits its commit. Work that grows
with the body (decoding and checking a large forward_backward) runs off the loop.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from treadle.artifacts import encryption
from treadle.artifacts import folders as artifacts
from treadle.errors import InvalidRequestError
from treadle.protocol.ops import (
    CheckpointInfo,
    CreateAdapter,
    LoadWeights,
    OpKind,
    OptimStep,
    PackageTarget,
    RecordTo,
    Sample,
    SaveSampler,
    SaveState,
    Snapshot,
)
from treadle.server.api.tinker.replies import sample_sequence_id
from treadle.server.core import lifetime, sequences, validation
from treadle.server.core.state import ServerState
from treadle.server.registry.bindings import check_binding
from treadle.server.registry.sources import LoadSource
from treadle.server.storage.rows import ModelRow, new_id
from treadle.server.tenancy.auth import DEV_TENANT, Tenant
from treadle.types import LoraConfig
from treadle.wire import codec
from treadle.wire.forward_backward_request import CUSTOM_LOSS
from treadle.wire.requests import (
    CreateModelRequest,
    LoadWeightsRequest,
    OptimStepRequest,
    SampleRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
)
from treadle.wire.sdk_requests import TTL_MAX_S

# Bodies up to this size are decoded on the event loop (microseconds); larger ones on a
# worker thread, so that one big request never stalls the others' polls.
INLINE_BODY_BYTES = 4096


def _future(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id}


async def _file(
    state: ServerState,
    engine: Any,
    kind: OpKind,
    payload: Any,
    tenant: Tenant,
    row: ModelRow,
    seq_id: int,
) -> dict[str, Any]:
    """File one of a training model's ops; → its submit reply."""
    rid = await state.futures.file(
        engine,
        kind,
        payload,
        tenant=tenant,
        session_id=row.session_id,
        model_id=row.model_id,
        seq_id=seq_id,
    )
    return _future(rid, row.model_id)


def _check_optimizer(cfg: Any, field: str) -> None:
    if cfg is not None and cfg.type != "adamw":
        raise InvalidRequestError(f"{field}.type: only 'adamw' is supported, got {cfg.type!r}")


async def create_model(state: ServerState, tenant: Tenant, body: CreateModelRequest) -> dict:
    state.sessions.require(body.session_id)
    engine = state.engines.require(body.base_model)
    _check_optimizer(body.optimizer_config, "optimizer_config")
    lora = body.lora_config or LoraConfig()
    spec = validation.lora_spec(lora, engine.facts)
    check_binding(body.model_package_group, body.output_path, tenant == DEV_TENANT)
    row = await state.models.create(
        tenant,
        body.session_id,
        body.model_seq_id,
        engine.name,
        lora.model_dump(),
        body.user_metadata,
        state.held_adapters(tenant),
    )
    await state.models.bind(row, body.model_package_group, body.output_path)
    return await _file(state, engine, OpKind.CREATE, CreateAdapter(spec), tenant, row, 0)


async def forward_backward(state: ServerState, tenant: Tenant, body: bytes) -> dict:
    msg = await _off_loop_if_big(len(body), codec.parse_forward_backward_request, body)
    seq_id = int(msg.seq_id)
    if (rid := await state.models.refiled(msg.model_id, seq_id)) is not None:
        return _future(rid, msg.model_id)
    row = state.models.require(msg.model_id)
    engine = state.engines.require(row.base_model)
    # a sparse tensor declares its size in a few bytes: what it densifies to counts
    size = max(len(body), 4 * _declared_cells(msg))
    async with state.futures.refusing(engine, tenant, row.session_id, row.model_id, seq_id):
        custom = None
        if msg.loss_fn == CUSTOM_LOSS:  # an uploaded loss, run in the same engine call
            loss_id = codec.loss_config(msg).get("loss_id")
            custom = await state.custom_losses.ref(loss_id, row.session_id)
        payload, spans = await _off_loop_if_big(size, _train_data, msg, state, engine.facts, custom)
        if sequences.needs_provenance(payload.loss_fn):
            await sequences.attach(state.journal, payload, spans, tenant.tenant_id, row.session_id)
    return await _file(
        state,
        engine,
        OpKind.FORWARD if msg.forward_only else OpKind.FORWARD_BACKWARD,
        payload,
        tenant,
        row,
        seq_id,
    )


def _train_data(msg: Any, state: ServerState, facts: Any, custom: Any) -> tuple[Any, list]:
    """→ the checked payload, and each datum's provenance spans (checked by `sequences`)."""
    arrays = codec.forward_backward_arrays(msg, state.config.limits.max_request_cells)
    spans = [(d.model_input_spans, d.loss_fn_input_spans) for d in arrays.data]
    return validation.train_data(arrays, facts, custom), spans


def _declared_cells(msg: Any) -> int:
    return sum(math.prod(t.shape) for d in msg.data for t in d.loss_fn_inputs.values())


async def _off_loop_if_big(size: int, fn: Any, *args: Any) -> Any:
    """fn(*args) here for a small request (`size` in bytes), else on a worker thread."""
    if size <= INLINE_BODY_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def optim_step(state: ServerState, tenant: Tenant, body: OptimStepRequest) -> dict:
    if (rid := await state.models.refiled(body.model_id, body.seq_id)) is not None:
        return _future(rid, body.model_id)
    row = state.models.require(body.model_id)
    engine = state.engines.require(row.base_model)
    async with state.futures.refusing(engine, tenant, row.session_id, row.model_id, body.seq_id):
        spec = validation.adam_spec(body)
    return await _file(state, engine, OpKind.OPTIM_STEP, OptimStep(spec), tenant, row, body.seq_id)


def _package(
    state: ServerState, row: ModelRow, key: bytes | None, stored: bool = True
) -> PackageTarget | None:
    """What a save publishes to (None: the model has no group). A key sent for a save that
    would store plain files is refused; an in-memory snapshot (stored=False) stores none."""
    package = state.bindings.target(row, key)
    if package is None and key is not None and stored:
        raise InvalidRequestError(
            "X-Treadle-Encryption-Key: encryption applies to model package versions; create "
            "the training client with model_package_group to store encrypted versions"
        )
    return package


def _ckpt(
    row: ModelRow, name: str, user_metadata: dict | None, ttl_seconds: int | None = None
) -> CheckpointInfo:
    if ttl_seconds is not None and not 1 <= ttl_seconds <= TTL_MAX_S:
        raise InvalidRequestError(
            f"ttl_seconds: expected 1 to {TTL_MAX_S} seconds or null (never expires), "
            f"got {ttl_seconds}"
        )
    return CheckpointInfo(
        name=name,
        run_id=row.run_id,
        base_model=row.base_model,
        lora_config=row.lora_config,
        tenant_id=row.tenant_id,
        user_metadata=user_metadata,
        ttl_s=ttl_seconds,
    )


async def save_weights(
    state: ServerState, tenant: Tenant, body: SaveWeightsRequest, key: bytes | None = None
) -> dict:
    if (rid := await state.models.refiled(body.model_id, body.seq_id)) is not None:
        return _future(rid, body.model_id)
    row = state.models.require(body.model_id)
    engine = state.engines.require(row.base_model)
    async with state.futures.refusing(engine, tenant, row.session_id, row.model_id, body.seq_id):
        name = artifacts.check_name(body.path)
        ckpt = _ckpt(row, name, body.user_metadata, body.ttl_seconds)
        await lifetime.check_quota(state.store, state.admission, tenant)
        payload = SaveState(ckpt, body.overwrite, _package(state, row, key))
    return await _file(state, engine, OpKind.SAVE_STATE, payload, tenant, row, body.seq_id)


async def save_weights_for_sampler(
    state: ServerState,
    tenant: Tenant,
    body: SaveWeightsForSamplerRequest,
    key: bytes | None = None,
    checkpoint_type: str = "sampler",
    age_recipients: list[str] | None = None,
) -> dict:
    """checkpoint_type "external": save_weights_external (the same PEFT adapter, under
    tinker://<run>/external_weights/<name>, downloadable file by file)."""
    if (rid := await state.models.refiled(body.model_id, body.seq_id)) is not None:
        return _future(rid, body.model_id)
    row = state.models.require(body.model_id)
    engine = state.engines.require(row.base_model)
    refusing = state.futures.refusing(engine, tenant, row.session_id, row.model_id, body.seq_id)
    if body.path is not None:
        async with refusing:
            name = artifacts.check_name(body.path)
            ckpt = _ckpt(row, name, body.user_metadata, body.ttl_seconds)
            await lifetime.check_quota(state.store, state.admission, tenant)
            package = _package(state, row, key)
            if age_recipients is not None:
                encryption.age_recipients(age_recipients)
            if body.merge_weights and package is None:
                raise InvalidRequestError(
                    "merge_weights: a merged model is published as a version of the session's "
                    "model package group; create the training client with model_package_group"
                )
        kind = OpKind.SAVE_SAMPLER
        payload: SaveSampler | Snapshot = SaveSampler(
            ckpt,
            package,
            body.merge_weights,
            checkpoint_type,
            age_recipients,
        )
    else:
        if body.sampling_session_seq_id is None:
            raise InvalidRequestError(
                "save_weights_for_sampler: send path or sampling_session_seq_id"
            )
        async with refusing:
            package = _package(state, row, key, stored=False)
        kind = OpKind.SNAPSHOT
        payload = Snapshot(
            sampling_session_id=new_id(),
            sampling_session_seq_id=body.sampling_session_seq_id,
            session_id=row.session_id,
            base_model=row.base_model,
            tenant_id=row.tenant_id,
            package=package,
        )
    return await _file(state, engine, kind, payload, tenant, row, body.seq_id)


async def load_weights(
    state: ServerState,
    tenant: Tenant,
    body: LoadWeightsRequest,
    source: LoadSource | None = None,
) -> dict:
    """Legacy form (model_id + seq_id) loads into an existing model; create-via-load
    (session_id + model_seq_id) makes model "<session_id>:train:<model_seq_id>" from it.
    `source`: a model package version already fetched (treadle.server.registry.sources)."""
    ckpt = source if source is not None else await state.checkpoints.get(body.path)
    _check_optimizer(body.optimizer_config, "optimizer_config")
    if body.optimizer and ckpt.checkpoint_type != "training":
        raise InvalidRequestError(
            f"optimizer: {body.path} holds sampler weights only; optimizer state lives in "
            "tinker://<run>/weights/<name> checkpoints"
        )
    payload = LoadWeights(
        dir=ckpt.dir,
        checkpoint_type=ckpt.checkpoint_type,
        optimizer=body.optimizer,
        path=body.path,
        cleanup=source is not None and source.cleanup,
    )
    if body.session_id is not None:
        if body.model_seq_id is None:
            raise InvalidRequestError("model_seq_id: required with session_id (create-via-load)")
        state.sessions.require(body.session_id)
        if body.base_model is not None and body.base_model != ckpt.base_model:
            raise InvalidRequestError(
                f"base_model: {body.base_model!r} does not match the checkpoint's {ckpt.base_model!r}"
            )
        engine = state.engines.require(ckpt.base_model)
        check_binding(body.model_package_group, body.output_path, tenant == DEV_TENANT)
        row = await state.models.create(
            tenant,
            body.session_id,
            body.model_seq_id,
            engine.name,
            ckpt.lora_config,
            body.user_metadata,
            state.held_adapters(tenant),
        )
        await state.models.bind(row, body.model_package_group, body.output_path)
        seq_id = 0
    elif body.model_id is not None:
        if (rid := await state.models.refiled(body.model_id, body.seq_id)) is not None:
            return _future(rid, body.model_id)
        row = state.models.require(body.model_id)
        if row.base_model != ckpt.base_model:
            raise InvalidRequestError(
                f"path: checkpoint of {ckpt.base_model!r} cannot load into a {row.base_model!r} model"
            )
        engine, seq_id = state.engines.require(row.base_model), body.seq_id
    else:
        raise InvalidRequestError(
            "load_weights: send model_id + seq_id or session_id + model_seq_id"
        )
    return await _file(state, engine, OpKind.LOAD, payload, tenant, row, seq_id)


def _sample_cells(body: SampleRequest) -> int:
    """The numbers an asample body makes the edge read: its prompt and target ids."""
    td = body.target_prompt_logprobs or {}
    shape, data = td.get("shape"), td.get("data")
    ints = isinstance(shape, list) and all(type(s) is int for s in shape)
    declared = abs(math.prod(shape)) if ints else 0
    return body.prompt.length + (len(data) if isinstance(data, list) else 0) + declared


async def asample(state: ServerState, tenant: Tenant, body: SampleRequest) -> dict:
    if body.sampling_session_id is None:
        raise InvalidRequestError(
            "sampling_session_id: required (create one with create_sampling_session)"
        )
    sampler = await state.samplers.require_live(body.sampling_session_id)
    engine = state.engines.require(sampler.base_model)
    default = state.admission.default_max_tokens(
        engine.name, engine.facts.max_seq_len, body.prompt.length
    )
    request = await _off_loop_if_big(
        8 * _sample_cells(body),
        validation.sample_request,
        body,
        sampler.engine_ref,
        engine.facts,
        default,
        state.config.limits,
        tenant.tenant_id,
    )
    # record_stability_info: its sequences are kept for the session's training requests
    record = RecordTo(tenant.tenant_id, sampler.session_id) if body.record_stability_info else None
    rid = await state.futures.file(
        engine,
        OpKind.SAMPLE,
        Sample(request, body.prompt_logprobs_last_n, record),
        tenant=tenant,
        session_id=sampler.session_id,
        seq_id=body.seq_id,
        sampling_session_id=body.sampling_session_id,
    )
    ids = [sample_sequence_id(rid, i) for i in range(body.num_samples)]
    return {"request_id": rid, "sample_sequence_ids": ids}
