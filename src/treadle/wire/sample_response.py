"""SampleResponse on the wire: sampled sequences, their logprobs and top-k matrices, and
the prompt's logprobs; the server encodes it, the SDK decodes it.

Top-k rows travel as N*K row-major matrices padded with an empty cell that the SDK's
topk_to_lists skips; a prompt position without a logprob travels as NaN.
"""

from __future__ import annotations

import math

import numpy as np

from treadle.types import SampledSequence, SampleResponse
from treadle.wire import tinker_pb2 as pb
from treadle.wire.tensors import _parse, tensor_from_proto, tensor_to_proto

# An empty cell of a top-k matrix, as the SDK's topk_to_lists reads it.
TOPK_EMPTY_ID = 0
TOPK_EMPTY_LOGPROB = -99999.0


def _topk_to_proto(rows: list[list[tuple[int, float]] | None]) -> pb.TopkLogprobs:
    """N*K row-major matrices; None rows and short rows are padded with the empty cell."""
    k = max((len(r) for r in rows if r), default=0)
    ids = np.full((len(rows), k), TOPK_EMPTY_ID, dtype="<i4")  # (N, K)
    lps = np.full((len(rows), k), TOPK_EMPTY_LOGPROB, dtype="<f4")  # (N, K)
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate(row or []):
            ids[i, j], lps[i, j] = tok, lp
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


def _topk_from_proto(msg: pb.TopkLogprobs) -> list[list[tuple[int, float]] | None]:
    n, k = msg.length, msg.k
    if n == 0 or k == 0:
        return [None] * n
    ids = np.frombuffer(msg.token_ids, dtype="<i4").reshape(n, k).tolist()
    lps = np.frombuffer(msg.logprobs, dtype="<f4").reshape(n, k).tolist()
    rows: list[list[tuple[int, float]] | None] = []
    for id_row, lp_row in zip(ids, lps, strict=True):
        cells = [(t, lp) for t, lp in zip(id_row, lp_row, strict=True)]
        while cells and cells[-1] == (TOPK_EMPTY_ID, TOPK_EMPTY_LOGPROB):
            cells.pop()
        rows.append(cells or None)
    return rows


def encode_sample_response(resp: SampleResponse) -> bytes:
    msg = pb.SampleResponse()
    for seq in resp.sequences:
        s = msg.sequences.add(
            stop_reason=pb.STOP_REASON_LENGTH
            if seq.stop_reason == "length"
            else pb.STOP_REASON_STOP,
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
        )
        if seq.logprobs is not None:
            s.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
        if seq.topk_logprobs is not None:
            s.topk_sampled_logprobs.CopyFrom(_topk_to_proto(seq.topk_logprobs))
        if seq.sampling_logprobs is not None:
            s.sampling_logprobs = np.asarray(seq.sampling_logprobs, dtype="<f4").tobytes()
    if resp.prompt_logprobs is not None:
        lps = [math.nan if lp is None else lp for lp in resp.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(lps, dtype="<f4").tobytes()
    if resp.topk_prompt_logprobs is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk_to_proto(resp.topk_prompt_logprobs))
    if resp.target_prompt_logprobs is not None:
        msg.target_prompt_logprobs.CopyFrom(tensor_to_proto(resp.target_prompt_logprobs))
    msg.prompt_cache_hit_tokens = resp.prompt_cache_hit_tokens
    if resp.prompt_alt_tokens is not None:
        ids, lps = resp.prompt_alt_tokens
        msg.prompt_alt_tokens.tokens.CopyFrom(tensor_to_proto(ids))
        msg.prompt_alt_tokens.logprobs.CopyFrom(tensor_to_proto(lps))
    return msg.SerializeToString()


def decode_sample_response(body: bytes) -> SampleResponse:
    msg = _parse(pb.SampleResponse, body, "SampleResponse")
    sequences = [
        SampledSequence(
            stop_reason="length" if s.stop_reason == pb.STOP_REASON_LENGTH else "stop",
            tokens=np.frombuffer(s.tokens, dtype="<i4").tolist(),
            logprobs=np.frombuffer(s.logprobs, dtype="<f4").tolist()
            if s.HasField("logprobs")
            else None,
            topk_logprobs=[row or [] for row in _topk_from_proto(s.topk_sampled_logprobs)]
            if s.HasField("topk_sampled_logprobs")
            else None,
            sampling_logprobs=np.frombuffer(s.sampling_logprobs, dtype="<f4").tolist()
            if s.HasField("sampling_logprobs")
            else None,
        )
        for s in msg.sequences
    ]
    prompt_logprobs = None
    if msg.HasField("prompt_logprobs"):
        raw = np.frombuffer(msg.prompt_logprobs, dtype="<f4").tolist()
        prompt_logprobs = [None if math.isnan(x) else x for x in raw]
    topk = (
        _topk_from_proto(msg.topk_prompt_logprobs) if msg.HasField("topk_prompt_logprobs") else None
    )
    target = None
    if msg.HasField("target_prompt_logprobs"):
        target = tensor_from_proto(msg.target_prompt_logprobs, "target_prompt_logprobs")
    alt = None
    if msg.HasField("prompt_alt_tokens"):
        alt = (
            tensor_from_proto(msg.prompt_alt_tokens.tokens, "prompt_alt_tokens.tokens"),
            tensor_from_proto(msg.prompt_alt_tokens.logprobs, "prompt_alt_tokens.logprobs"),
        )
    return SampleResponse(
        sequences=sequences,
        prompt_logprobs=prompt_logprobs,
        topk_prompt_logprobs=topk,
        target_prompt_logprobs=target,
        prompt_alt_tokens=alt,
        prompt_cache_hit_tokens=msg.prompt_cache_hit_tokens,
    )
