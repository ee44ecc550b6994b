"""Checks at the API edge, so a bad request gets a 400 naming its field at once, and the
translation of wire bodies into the engine's typed inputs.

The rules themselves are the engine's (treadle.engine.specs): one table, applied here
before anything is queued and again by the engine before any model work.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from treadle.engine.loss_graph_spec import LossGraph, validate_custom_batch
from treadle.engine.specs import (
    MAX_TOPK_COLUMNS,
    check_fit,
    check_ids,
    validate_adam,
    validate_sample_request,
    validate_train_batch,
)
from treadle.engine.types import AdamSpec, Constraint, LoraSpec, SampleSpec, TrainDatum
from treadle.engine.types import SampleRequest as EngineSampleRequest
from treadle.errors import InvalidRequestError
from treadle.protocol.facts import EngineFacts
from treadle.protocol.ops import CustomLossRef, TrainData
from treadle.server.config import InputLimits
from treadle.types import LoraConfig, SamplingParams
from treadle.wire.codec import ForwardBackwardArrays
from treadle.wire.requests import OptimStepRequest, SampleRequest

MAX_NUM_SAMPLES = 256
MAX_LORA_ALPHA = 1e6
INT64 = (-(2**63), 2**63 - 1)
DEFAULT_LIMITS = InputLimits()


def _int64(value: int | None, field: str) -> None:
    """Seeds reach torch as int64: one outside that range is the caller's mistake."""
    if value is not None and not INT64[0] <= value <= INT64[1]:
        raise InvalidRequestError(f"{field}: expected a 64-bit integer, got {value}")


def train_data(
    fb: ForwardBackwardArrays,
    facts: EngineFacts,
    custom: tuple[CustomLossRef, LossGraph] | None = None,
) -> TrainData:
    """A decoded forward/forward_backward body → the op's payload, checked; `custom`: the
    uploaded loss a loss_fn "custom" names (treadle.server.core.custom_losses)."""
    data = [TrainDatum(d.tokens, d.loss_fn_inputs) for d in fb.data]
    if custom is not None:
        ref, graph = custom
        unknown = sorted(set(fb.loss_fn_config) - {"loss_id"})
        if unknown:
            raise InvalidRequestError(
                f"loss_fn_config[{unknown[0]!r}]: loss_fn 'custom' takes only loss_id"
            )
        validate_custom_batch(graph, data, facts.vocab_size, facts.max_seq_len)
        check_fit([len(d.tokens) for d in data], facts.max_train_tokens)
        return TrainData(data, fb.loss_fn, {}, ref)
    for key, value in fb.loss_fn_config.items():
        if isinstance(value, str):
            raise InvalidRequestError(
                f"loss_fn_config[{key!r}]: expected a finite number, got {value!r}"
            )
    config = validate_train_batch(
        data, fb.loss_fn, fb.loss_fn_config, facts.vocab_size, facts.max_seq_len
    )
    # before anything is queued: a sequence the engine's memory cannot hold in one pass
    check_fit([len(d.tokens) for d in data], facts.max_train_tokens)
    return TrainData(data, fb.loss_fn, config)


def adam_spec(body: OptimStepRequest) -> AdamSpec:
    if body.adam_params is None:
        kind = (body.optimizer_params or {}).get("type")
        raise InvalidRequestError(f"adam_params: required (optimizer {kind!r} is not supported)")
    spec = AdamSpec(**body.adam_params.model_dump())
    validate_adam(spec)
    return spec


def lora_spec(cfg: LoraConfig, facts: EngineFacts) -> LoraSpec:
    """A create_model's lora_config, checked against the model before anything is made."""
    if cfg.rank < 1:
        raise InvalidRequestError(f"lora_config.rank: expected >= 1, got {cfg.rank}")
    if cfg.rank > facts.max_lora_rank:
        raise InvalidRequestError(
            f"lora_config.rank: {cfg.rank} exceeds the largest useful rank of {facts.name!r}, "
            f"{facts.max_lora_rank} (the width of its layers)"
        )
    if not (cfg.train_attn or cfg.train_mlp or cfg.train_unembed):
        raise InvalidRequestError(
            "lora_config: at least one of train_attn/mlp/unembed must be true"
        )
    _int64(cfg.seed, "lora_config.seed")
    alpha = float(cfg.alpha) if cfg.alpha is not None else 32.0
    if not math.isfinite(alpha) or not 0 < alpha <= MAX_LORA_ALPHA:
        raise InvalidRequestError(
            f"lora_config.alpha: expected a number in (0, {MAX_LORA_ALPHA:g}], got {cfg.alpha}"
        )
    return LoraSpec(
        rank=cfg.rank,
        alpha=alpha,
        seed=cfg.seed or 0,
        train_attn=cfg.train_attn,
        train_mlp=cfg.train_mlp,
        train_unembed=cfg.train_unembed,
    )


def sample_request(
    req: SampleRequest,
    adapter: str | None,
    facts: EngineFacts,
    default_max_tokens: int | None,
    limits: InputLimits = DEFAULT_LIMITS,
    scope: str = "",
) -> EngineSampleRequest:
    """Validate an asample body and translate it into the engine's request. `scope`: whose
    cached prompt prefixes it may use (the tenant; treadle.engine.prefix_cache).

    Sizes come first: the cells of every requested table (target ids, top-K logprobs,
    alternative tokens) are checked against `limits` before any of them exists."""
    P, max_len = req.prompt.length, facts.max_seq_len
    if P == 0:
        raise InvalidRequestError("prompt: expected at least one token, got none")
    if P >= max_len:
        raise InvalidRequestError(
            f"prompt: length {P} leaves no room to sample (max_seq_len {max_len})"
        )
    prompt = _ints(req.prompt.to_ints(), "prompt")
    check_ids(prompt, facts.vocab_size, "prompt")
    if not 1 <= req.num_samples <= MAX_NUM_SAMPLES:
        raise InvalidRequestError(
            f"num_samples: expected 1..{MAX_NUM_SAMPLES}, got {req.num_samples}"
        )
    _int64(req.sampling_params.seed, "sampling_params.seed")
    _check_result_cells(req, P, limits.max_result_cells)
    target_ids = None
    if req.target_prompt_logprobs is not None:
        target_ids = target_prompt_ids(
            req.target_prompt_logprobs, P, facts.vocab_size, limits.max_request_cells
        )
    if req.prompt_logprobs_last_n is not None:
        if not req.prompt_logprobs:
            raise InvalidRequestError("prompt_logprobs_last_n: needs prompt_logprobs=true")
        if not 1 <= req.prompt_logprobs_last_n <= P - 1:
            raise InvalidRequestError(
                f"prompt_logprobs_last_n: expected 1..{P - 1}, got {req.prompt_logprobs_last_n}"
            )
    sp = req.sampling_params
    room = max_len - P
    max_tokens = sp.max_tokens if sp.max_tokens is not None else default_max_tokens or room
    if not 1 <= max_tokens <= room:
        raise InvalidRequestError(
            f"sampling_params.max_tokens: expected 1..{room} (max_seq_len {max_len} minus "
            f"the {P} prompt tokens), got {max_tokens}"
        )
    if sp.top_k == 0:
        raise InvalidRequestError(f"sampling_params.top_k: expected -1 or >= 1, got {sp.top_k}")
    stop_strings, stop_tokens = _stops(sp.stop, facts.vocab_size)
    spec = SampleSpec(
        max_tokens=max_tokens,
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        seed=sp.seed,
        stop_strings=stop_strings,
        stop_tokens=stop_tokens,
        stop_at_eos=sp.stop is None or bool(sp.stop),  # stop=[] ignores EOS
        **sampling_controls(sp),
    )
    out = EngineSampleRequest(
        prompt=prompt,
        num_samples=req.num_samples,
        params=spec,
        adapter=adapter,
        prompt_logprobs=bool(req.prompt_logprobs),
        topk_prompt_logprobs=req.topk_prompt_logprobs,
        target_prompt_ids=target_ids,
        topk_sample_logprobs=req.topk_sample_logprobs,
        prompt_alt_tokens_k=req.prompt_alt_tokens_k,
        prefix_scope=scope,
    )
    validate_sample_request(out, facts.vocab_size, max_len)
    return out


def sampling_controls(sp: SamplingParams) -> dict[str, Any]:
    """The wire's sampling controls as SampleSpec fields (their values checked later, by
    validate_sample_request): at most one of json_schema, regex and grammar."""
    kinds = [k for k in ("json_schema", "regex", "grammar") if getattr(sp, k) is not None]
    if len(kinds) > 1:
        raise InvalidRequestError(
            f"sampling_params.{kinds[1]}: only one constraint per request, got {kinds}"
        )
    out: dict[str, Any] = {
        "min_p": 0.0 if sp.min_p is None else sp.min_p,
        "logit_bias": dict(sp.logit_bias or {}),
        "presence_penalty": sp.presence_penalty or 0.0,
        "frequency_penalty": sp.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if sp.repetition_penalty is None else sp.repetition_penalty,
    }
    if kinds:
        source = getattr(sp, kinds[0])
        if kinds[0] == "json_schema" and not isinstance(source, str):
            source = json.dumps(source)
        out["constraint"] = Constraint(kinds[0], source)
    return out


def _check_result_cells(req: SampleRequest, P: int, max_cells: int) -> None:
    """The tables a sample request asks for, by their cells, before anything is made: each
    cell is a (token id, logprob) the engine computes, stores and sends back."""
    sp = req.sampling_params
    samples = req.num_samples * (sp.max_tokens if sp.max_tokens is not None else 1)
    asked = {
        "topk_prompt_logprobs": max(req.topk_prompt_logprobs, 0) * (P - 1),
        "prompt_alt_tokens_k": max(req.prompt_alt_tokens_k, 0) * (P - 1),
        "topk_sample_logprobs": max(req.topk_sample_logprobs, 0) * max(samples, 0),
    }
    if sum(asked.values()) > max_cells:
        detail = ", ".join(f"{k} {v}" for k, v in asked.items() if v)
        raise InvalidRequestError(
            f"this request asks for {sum(asked.values())} logprob cells ({detail}), over the "
            f"input limit max_result_cells {max_cells}; ask for fewer columns or a shorter "
            "prompt"
        )


def _ints(values: list[int], field: str) -> list[int]:
    """Token ids beyond int64 are outside any vocabulary: refused before numpy sees them."""
    if values and not (INT64[0] <= min(values) and max(values) <= INT64[1]):
        raise InvalidRequestError(f"{field}: token ids must be 64-bit integers")
    return values


def target_prompt_ids(
    td: dict[str, Any],
    prompt_len: int,
    vocab_size: int,
    max_cells: int = DEFAULT_LIMITS.max_request_cells,
) -> np.ndarray:
    """The SDK's target_prompt_logprobs TensorData JSON → (P-1, K) int64 ids, -1 = none.

    Dense: `data` holds all P-1 rows of K. Sparse CSR (TensorData.from_torch_sparse with
    pad -1): `sparse_crow_indices` / `sparse_col_indices` list the requested cells and `data`
    their ids; every other cell asks for nothing. The (P-1, K) table is checked against
    `max_cells` (and K against the top-K bound) before it exists.
    """
    field = "target_prompt_logprobs"
    if td.get("dtype") != "int64":
        raise InvalidRequestError(
            f"{field}.dtype: expected int64 token ids, got {td.get('dtype')!r}"
        )
    shape = td.get("shape")
    if not isinstance(shape, list) or len(shape) != 2 or shape[0] != prompt_len - 1:
        raise InvalidRequestError(
            f"{field}.shape: expected [{prompt_len - 1}, K] (prompt length - 1 rows), got {shape}"
        )
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise InvalidRequestError(f"{field}.shape: expected two integers, got {shape}")
    rows, K = shape
    if not 1 <= K <= MAX_TOPK_COLUMNS:  # checked before the dense (P-1, K) ids exist
        raise InvalidRequestError(
            f"{field}.shape: expected 1 <= K <= {MAX_TOPK_COLUMNS} columns, got {shape}"
        )
    if rows * K > max_cells:
        raise InvalidRequestError(
            f"{field}.shape: {shape} holds {rows * K} cells, over the input limit "
            f"max_request_cells {max_cells}"
        )
    try:
        values = np.asarray(td.get("data") or [], dtype=np.int64)
        crow, col = td.get("sparse_crow_indices"), td.get("sparse_col_indices")
        if crow is None:
            if values.size != rows * K:
                raise InvalidRequestError(
                    f"{field}.data: shape {shape} needs {rows * K} ids, got {values.size}"
                )
            ids = values.reshape(rows, K)
        else:
            crow_a, col_a = np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)
            ok = (
                crow_a.shape == (rows + 1,)
                and crow_a[0] == 0
                and (np.diff(crow_a) >= 0).all()
                and crow_a[-1] == col_a.size == values.size
                and ((col_a >= 0) & (col_a < K)).all()
            )
            if not ok:
                raise InvalidRequestError(
                    f"{field}: inconsistent sparse CSR (crow {crow_a.size} entries for {rows} "
                    f"rows, {col_a.size} columns, {values.size} values, K={K})"
                )
            ids = np.full((rows, K), -1, dtype=np.int64)  # (P-1, K)
            ids[np.repeat(np.arange(rows), np.diff(crow_a)), col_a] = values
    except (TypeError, ValueError, OverflowError, IndexError) as e:
        if isinstance(e, InvalidRequestError):
            raise
        raise InvalidRequestError(f"{field}: expected integer token ids ({e})") from e
    bad = np.flatnonzero(((ids < -1) | (ids >= vocab_size)).reshape(-1))
    if bad.size:
        r, c = divmod(int(bad[0]), K)
        raise InvalidRequestError(
            f"{field}[{r}][{c}]: token id {int(ids[r, c])} is outside the vocabulary "
            f"[0, {vocab_size}) (-1 asks for nothing)"
        )
    return ids


def _stops(stop: str | list | None, vocab_size: int) -> tuple[list[str], list[int]]:
    if stop is None:
        return [], []
    if isinstance(stop, str):
        return [stop], []
    if all(isinstance(s, str) for s in stop):
        return list(stop), []
    if all(isinstance(s, int) for s in stop):
        check_ids(list(stop), vocab_size, "sampling_params.stop")
        return [], list(stop)
    raise InvalidRequestError(
        f"sampling_params.stop: expected a string, a list of strings or a list of token ids, "
        f"got {stop!r}"
    )
