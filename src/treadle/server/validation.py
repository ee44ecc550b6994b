"""Cheap checks at the API edge, so a bad request gets a 400 naming its field at once.

Anything subtler is left to the engine, whose InvalidRequestError becomes a failed future
with category "user".
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from treadle.engine.types import SampleRequest as EngineSampleRequest
from treadle.engine.types import SampleSpec
from treadle.errors import InvalidRequestError
from treadle.types import Datum, ModelInput
from treadle.wire.requests import SampleRequest

# loss → loss_fn_inputs it needs besides the ones every loss accepts
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}
MAX_NUM_SAMPLES = 256


def check_tokens(tokens: list[int], vocab_size: int, field: str) -> None:
    if not tokens:
        return
    array = np.asarray(tokens)
    bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise InvalidRequestError(
            f"{field}[{i}]: token id {int(array[i])} is outside the vocabulary [0, {vocab_size})"
        )


def check_train_request(
    data: list[Datum],
    loss_fn: str,
    loss_fn_config: dict[str, float | str],
    vocab_size: int,
    max_seq_len: int,
) -> dict[str, float]:
    """Validate a forward/forward_backward request; → the numeric loss config."""
    if loss_fn not in LOSS_INPUTS:
        raise InvalidRequestError(
            f"loss_fn: unknown loss {loss_fn!r}; this server supports {sorted(LOSS_INPUTS)}"
        )
    config: dict[str, float] = {}
    for key, value in loss_fn_config.items():
        if isinstance(value, str) or not math.isfinite(value):
            raise InvalidRequestError(
                f"loss_fn_config[{key!r}]: expected a finite number, got {value!r}"
            )
        config[key] = float(value)
    if not data:
        raise InvalidRequestError("data: expected at least one datum, got none")
    for i, datum in enumerate(data):
        tokens = datum.model_input.to_ints()
        T = len(tokens)
        if T == 0 or T > max_seq_len:
            raise InvalidRequestError(
                f"data[{i}].model_input: length must be in [1, {max_seq_len}], got {T}"
            )
        check_tokens(tokens, vocab_size, f"data[{i}].model_input")
        for key in LOSS_INPUTS[loss_fn]:
            if key not in datum.loss_fn_inputs:
                raise InvalidRequestError(
                    f"data[{i}].loss_fn_inputs: {loss_fn} needs {key!r}, got keys "
                    f"{sorted(datum.loss_fn_inputs)}"
                )
        for key, td in datum.loss_fn_inputs.items():
            shape = td.shape if td.shape is not None else [len(td.data)]
            if not shape or shape[0] != T:
                raise InvalidRequestError(
                    f"data[{i}].loss_fn_inputs[{key!r}]: expected leading length {T} "
                    f"(the model_input length), got shape {shape}"
                )
            if key == "target_tokens":
                if td.dtype != "int64":
                    raise InvalidRequestError(
                        f"data[{i}].loss_fn_inputs['target_tokens']: expected int64, got {td.dtype}"
                    )
                check_tokens(
                    list(td.data), vocab_size, f"data[{i}].loss_fn_inputs['target_tokens']"
                )
    return config


def to_engine_sample_request(
    req: SampleRequest, adapter: str | None, vocab_size: int, max_seq_len: int
) -> EngineSampleRequest:
    """Validate an asample body and translate it into the engine's request."""
    prompt = _prompt_tokens(req.prompt)
    check_tokens(prompt, vocab_size, "prompt")
    P = len(prompt)
    if P == 0:
        raise InvalidRequestError("prompt: expected at least one token, got none")
    if P >= max_seq_len:
        raise InvalidRequestError(
            f"prompt: length {P} leaves no room to sample (max_seq_len {max_seq_len})"
        )
    if not 1 <= req.num_samples <= MAX_NUM_SAMPLES:
        raise InvalidRequestError(
            f"num_samples: expected 1..{MAX_NUM_SAMPLES}, got {req.num_samples}"
        )
    for field in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        k = getattr(req, field)
        if not 0 <= k <= vocab_size:
            raise InvalidRequestError(f"{field}: expected 0..{vocab_size}, got {k}")
    target_ids = None
    if req.target_prompt_logprobs is not None:
        target_ids = target_prompt_ids(req.target_prompt_logprobs, P, vocab_size)
    if req.prompt_logprobs_last_n is not None:
        if not req.prompt_logprobs:
            raise InvalidRequestError("prompt_logprobs_last_n: needs prompt_logprobs=true")
        if not 1 <= req.prompt_logprobs_last_n <= P - 1:
            raise InvalidRequestError(
                f"prompt_logprobs_last_n: expected 1..{P - 1}, got {req.prompt_logprobs_last_n}"
            )
    sp = req.sampling_params
    room = max_seq_len - P
    max_tokens = room if sp.max_tokens is None else sp.max_tokens
    if not 1 <= max_tokens <= room:
        raise InvalidRequestError(
            f"sampling_params.max_tokens: expected 1..{room} (max_seq_len {max_seq_len} minus "
            f"the {P} prompt tokens), got {max_tokens}"
        )
    if sp.temperature < 0 or not math.isfinite(sp.temperature):
        raise InvalidRequestError(
            f"sampling_params.temperature: expected >= 0, got {sp.temperature}"
        )
    if not 0 < sp.top_p <= 1:
        raise InvalidRequestError(f"sampling_params.top_p: expected in (0, 1], got {sp.top_p}")
    if sp.top_k == 0 or sp.top_k < -1:
        raise InvalidRequestError(f"sampling_params.top_k: expected -1 or >= 1, got {sp.top_k}")
    stop_strings, stop_tokens = _stops(sp.stop, vocab_size)
    spec = SampleSpec(
        max_tokens=max_tokens,
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        seed=sp.seed,
        stop_strings=stop_strings,
        stop_tokens=stop_tokens,
        stop_at_eos=sp.stop is None or bool(sp.stop),  # stop=[] ignores EOS
    )
    return EngineSampleRequest(
        prompt=prompt,
        num_samples=req.num_samples,
        params=spec,
        adapter=adapter,
        prompt_logprobs=bool(req.prompt_logprobs),
        topk_prompt_logprobs=req.topk_prompt_logprobs,
        target_prompt_ids=target_ids,
        topk_sample_logprobs=req.topk_sample_logprobs,
        prompt_alt_tokens_k=req.prompt_alt_tokens_k,
    )


def target_prompt_ids(td: dict[str, Any], prompt_len: int, vocab_size: int) -> np.ndarray:
    """The SDK's target_prompt_logprobs TensorData JSON → (P-1, K) int64 ids, -1 = none.

    Dense: `data` holds all P-1 rows of K. Sparse CSR (TensorData.from_torch_sparse with
    pad -1): `sparse_crow_indices` / `sparse_col_indices` list the requested cells and `data`
    their ids; every other cell asks for nothing.
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
    rows, K = int(shape[0]), int(shape[1])
    if K < 1:
        raise InvalidRequestError(f"{field}.shape: expected K >= 1 columns, got {shape}")
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
    except (TypeError, ValueError) as e:
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


def _prompt_tokens(prompt: ModelInput) -> list[int]:
    return prompt.to_ints()


def _stops(stop: str | list | None, vocab_size: int) -> tuple[list[str], list[int]]:
    if stop is None:
        return [], []
    if isinstance(stop, str):
        return [stop], []
    if all(isinstance(s, str) for s in stop):
        return list(stop), []
    if all(isinstance(s, int) for s in stop):
        check_tokens(list(stop), vocab_size, "sampling_params.stop")
        return [], list(stop)
    raise InvalidRequestError(
        f"sampling_params.stop: expected a string, a list of strings or a list of token ids, "
        f"got {stop!r}"
    )
