"""Protobuf ⇄ treadle.types for the Tinker wire format (SDK 0.38), in both directions.

The server decodes forward_backward requests and encodes ForwardBackwardOutput and
SampleResponse results; the treadle SDK does the opposite, with the same functions.
Byte fields hold little-endian numpy `.tobytes()` data (see tinker.proto).

Anything malformed raises InvalidRequestError with a message naming the field, so that the
server can answer 400 without touching the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from treadle.errors import InvalidRequestError
from treadle.types import (
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ModelInput,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
    SampledSequence,
    SampleResponse,
    TensorData,
)
from treadle.wire import tinker_pb2 as pb

# Zero-length provenance runs a datum may carry beyond one run per position.
MAX_EMPTY_SPANS = 16
# An empty cell of a top-k matrix, as the SDK's topk_to_lists reads it.
TOPK_EMPTY_ID = 0
TOPK_EMPTY_LOGPROB = -99999.0

_NP_OF_DTYPE: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),  # widened to float32 after reading
}
_WIRE_OF_DTYPE: dict[int, str] = {
    pb.DTYPE_FLOAT32: "float32",
    pb.DTYPE_BFLOAT16: "float32",
    pb.DTYPE_INT64: "int64",
    pb.DTYPE_INT32: "int64",
}
_PB_OF_WIRE = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}
_NP_OF_WIRE = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8")}


# ---- small helpers ------------------------------------------------------------------------


def _parse(message: type, body: bytes, what: str):
    msg = message()
    try:
        msg.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise InvalidRequestError(f"body: not a valid protobuf {what} ({e})") from e
    return msg


def _frombuffer(raw: bytes, dtype: np.dtype, field: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise InvalidRequestError(
            f"{field}: {len(raw)} bytes is not a multiple of the {dtype.itemsize}-byte item size"
        )
    return np.frombuffer(raw, dtype=dtype)


def _widen(array: np.ndarray, dtype: int) -> np.ndarray:
    """bf16 → float32 (bit-exact), int32 → int64; the public wire has only those two."""
    if dtype == pb.DTYPE_BFLOAT16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    if dtype == pb.DTYPE_INT32:
        return array.astype(np.int64)
    return array


def _tensor_data(array: np.ndarray, wire_dtype: str) -> TensorData:
    return TensorData(data=array.reshape(-1).tolist(), dtype=wire_dtype, shape=list(array.shape))


# ---- Tensor ---------------------------------------------------------------------------------


def tensor_to_proto(td: TensorData) -> pb.Tensor:
    """Dense only: our TensorData carries no CSR form."""
    array = td.to_numpy().astype(_NP_OF_WIRE[td.dtype], copy=False)
    msg = pb.Tensor(dtype=_PB_OF_WIRE[td.dtype], shape=list(array.shape))
    msg.dense = array.tobytes()
    return msg


def tensor_from_proto(msg: pb.Tensor, field: str) -> TensorData:
    """Decode a dense or sparse-CSR Tensor; CSR is densified with 0 in unlisted cells."""
    return _tensor_data(tensor_array(msg, field), _WIRE_OF_DTYPE.get(msg.dtype, "float32"))


def tensor_array(
    msg: pb.Tensor, field: str, lead: int | None = None, max_cells: int | None = None
) -> np.ndarray:
    """A Tensor as a numpy array (float32 or int64).

    Sizes are checked before anything is allocated: with `lead`, the first dimension must
    be `lead`; with `max_cells`, the array may hold at most that many cells (a sparse CSR
    tensor declares its shape in a few bytes, so its densified size is checked, not its
    body's).
    """
    if msg.dtype not in _NP_OF_DTYPE:
        raise InvalidRequestError(
            f"{field}.dtype: expected FLOAT32, INT64, INT32 or BFLOAT16, got {msg.dtype}"
        )
    np_dtype = _NP_OF_DTYPE[msg.dtype]
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise InvalidRequestError(f"{field}.shape: negative size in {shape}")
    sparse = msg.WhichOneof("encoding") == "sparse_csr"
    if shape or sparse:
        if lead is not None and (not shape or shape[0] != lead):
            raise InvalidRequestError(
                f"{field}: expected leading length {lead} (the model_input length), "
                f"got shape {shape}"
            )
        if max_cells is not None and math.prod(shape) > max_cells:
            raise InvalidRequestError(
                f"{field}: shape {shape} holds {math.prod(shape)} cells, over the limit "
                f"of {max_cells} for this request"
            )
    if sparse:
        return _csr_to_dense(msg, np_dtype, shape, field)
    values = _widen(_frombuffer(msg.dense, np_dtype, f"{field}.dense"), msg.dtype)
    if not shape:
        if lead is not None and values.size != lead:
            raise InvalidRequestError(
                f"{field}: expected leading length {lead} (the model_input length), "
                f"got {values.size} values"
            )
        return values
    if math.prod(shape) != values.size:
        raise InvalidRequestError(
            f"{field}: shape {shape} needs {math.prod(shape)} values, got {values.size}"
        )
    return values.reshape(shape)


def _csr_to_dense(msg: pb.Tensor, np_dtype: np.dtype, shape: list[int], field: str) -> np.ndarray:
    if len(shape) != 2:
        raise InvalidRequestError(f"{field}.shape: a sparse CSR tensor needs 2 dims, got {shape}")
    rows, cols = shape
    csr = msg.sparse_csr
    values = _widen(_frombuffer(csr.values, np_dtype, f"{field}.sparse_csr.values"), msg.dtype)
    crow = _frombuffer(csr.crow_indices, np.dtype("<i8"), f"{field}.sparse_csr.crow_indices")
    col = _frombuffer(csr.col_indices, np.dtype("<i8"), f"{field}.sparse_csr.col_indices")
    if crow.size != rows + 1:
        raise InvalidRequestError(
            f"{field}.sparse_csr.crow_indices: expected {rows + 1} entries, got {crow.size}"
        )
    if col.size != values.size:
        raise InvalidRequestError(
            f"{field}.sparse_csr: {col.size} col_indices for {values.size} values"
        )
    if crow[0] != 0 or crow[-1] != values.size or np.any(np.diff(crow) < 0):
        raise InvalidRequestError(
            f"{field}.sparse_csr.crow_indices: must rise from 0 to {values.size}"
        )
    if col.size and (col.min() < 0 or col.max() >= cols):
        raise InvalidRequestError(f"{field}.sparse_csr.col_indices: must lie in [0, {cols})")
    dense = np.zeros((rows, cols), dtype=values.dtype)  # (N, K)
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_of, col] = values
    return dense


# ---- forward_backward request ---------------------------------------------------------------


def encode_forward_backward_request(
    model_id: str,
    seq_id: int,
    data: list[Datum],
    loss_fn: str,
    loss_fn_config: dict[str, float | str] | None,
    forward_only: bool,
) -> bytes:
    """As the tinker SDK writes it: numbers go to both config maps, strings to v2 only."""
    msg = pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id, loss_fn=loss_fn, forward_only=forward_only
    )
    for key, value in (loss_fn_config or {}).items():
        if isinstance(value, str):
            msg.loss_fn_config_v2[key].text = value
        else:
            msg.loss_fn_config[key] = float(value)
            msg.loss_fn_config_v2[key].number = float(value)
    for datum in data:
        datum_msg = msg.data.add()
        for chunk in datum.model_input.chunks:
            datum_msg.model_input.add().encoded_text.tokens = np.asarray(
                chunk.tokens, dtype="<i4"
            ).tobytes()
        for key, td in datum.loss_fn_inputs.items():
            datum_msg.loss_fn_inputs[key].CopyFrom(tensor_to_proto(td))
        for spans, field in (
            (datum.model_input_spans, datum_msg.model_input_spans),
            (datum.loss_fn_input_spans, datum_msg.loss_fn_input_spans),
        ):
            for span in spans or ():
                arm = field.add()
                arm = arm.sampled_tokens if span.type == "sampled" else arm.prompt_tokens
                arm.sequence_id, arm.offset, arm.length = span.sequence_id, span.offset, span.length
    return msg.SerializeToString()


@dataclass(frozen=True)
class Span:
    """One provenance run of a datum field: `length` positions that are positions
    [offset, offset + length) of the sampled tokens (sampled) or of the prompt (not sampled)
    of the sequence `sequence_id`."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass
class DatumArrays:
    """One datum of a forward_backward request, as the server reads it: numpy, no lists."""

    tokens: np.ndarray  # (T,) int64
    loss_fn_inputs: dict[str, np.ndarray]  # (T,) or (T, K); float32 or int64
    # provenance: runs tiling model_input / target_tokens; None when the datum has none
    model_input_spans: list[Span] | None = None
    loss_fn_input_spans: list[Span] | None = None


@dataclass
class ForwardBackwardArrays:
    model_id: str
    seq_id: int
    data: list[DatumArrays]
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool


def parse_forward_backward_request(body: bytes) -> pb.ForwardBackwardRequest:
    """The protobuf message, parsed but not yet read into arrays (its model_id, seq_id and
    forward_only are known, its tensors not yet checked)."""
    return _parse(pb.ForwardBackwardRequest, body, "ForwardBackwardRequest")


def forward_backward_arrays(
    msg: pb.ForwardBackwardRequest, max_cells: int
) -> ForwardBackwardArrays:
    """A parsed ForwardBackwardRequest as numpy arrays, checked before anything is
    allocated: every loss input leads with its datum's model_input length, and all the loss
    inputs of the request hold at most `max_cells` cells together (a sparse tensor is
    densified only within that budget). loss_fn_config_v2 wins over the legacy map."""
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is not None:
            config[key] = value.number if kind == "number" else value.text
    data, budget = [], max_cells
    for i, d in enumerate(msg.data):
        datum = _datum_arrays(d, f"data[{i}]", budget)
        budget -= sum(a.size for a in datum.loss_fn_inputs.values())
        data.append(datum)
    return ForwardBackwardArrays(
        msg.model_id, int(msg.seq_id), data, msg.loss_fn, config, bool(msg.forward_only)
    )


def _datum_arrays(msg: pb.Datum, field: str, max_cells: int) -> DatumArrays:
    parts = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidRequestError(
                f"{field}.model_input[{j}]: only encoded_text chunks are supported, got {kind}"
            )
        parts.append(
            _frombuffer(chunk.encoded_text.tokens, np.dtype("<i4"), f"{field}.model_input")
        )
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    inputs = {}
    for key, t in sorted(msg.loss_fn_inputs.items()):
        where = f"{field}.loss_fn_inputs[{key!r}]"
        inputs[key] = tensor_array(t, where, lead=len(tokens), max_cells=max_cells)
        max_cells -= inputs[key].size
    return DatumArrays(
        tokens,
        inputs,
        _spans(msg.model_input_spans, f"{field}.model_input_spans", len(tokens)),
        _spans(msg.loss_fn_input_spans, f"{field}.loss_fn_input_spans", len(tokens)),
    )


def _spans(msgs: Any, field: str, n_positions: int) -> list[Span] | None:
    """Provenance runs as read; their meaning (tiling, the sequences named) is checked by
    the server against what it recorded. An empty list is no provenance."""
    if not msgs:
        return None
    if len(msgs) > n_positions + MAX_EMPTY_SPANS:
        raise InvalidRequestError(
            f"{field}: {len(msgs)} spans for {n_positions} positions (runs tile the field)"
        )
    out = []
    for j, msg in enumerate(msgs):
        kind = msg.WhichOneof("span")
        if kind is None:
            raise InvalidRequestError(f"{field}[{j}]: expected prompt_tokens or sampled_tokens")
        arm = getattr(msg, kind)
        if not arm.sequence_id or arm.offset < 0 or arm.length < 0:
            raise InvalidRequestError(
                f"{field}[{j}]: expected a sequence_id, offset >= 0 and length >= 0, got "
                f"{arm.sequence_id!r}, {arm.offset}, {arm.length}"
            )
        out.append(
            Span(kind == "sampled_tokens", arm.sequence_id, int(arm.offset), int(arm.length))
        )
    return out


def _wire_spans(spans: list[Span] | None) -> list | None:
    if spans is None:
        return None
    return [
        (SampledProvenanceSpan if s.sampled else PromptProvenanceSpan)(
            sequence_id=s.sequence_id, offset=s.offset, length=s.length
        )
        for s in spans
    ]


def decode_forward_backward_request(
    body: bytes,
) -> tuple[str, int, list[Datum], str, dict[str, float | str], bool]:
    """The same request as wire Datums: → (model_id, seq_id, data, loss_fn, loss_fn_config,
    forward_only). For tools and tests; the server reads arrays."""
    fb = forward_backward_arrays(parse_forward_backward_request(body), max_cells=2**62)
    data = [
        Datum(
            model_input=ModelInput(chunks=[EncodedTextChunk(tokens=d.tokens.tolist())]),
            loss_fn_inputs={
                k: _tensor_data(v, "int64" if v.dtype.kind == "i" else "float32")
                for k, v in d.loss_fn_inputs.items()
            },
            model_input_spans=_wire_spans(d.model_input_spans),
            loss_fn_input_spans=_wire_spans(d.loss_fn_input_spans),
        )
        for d in fb.data
    ]
    return fb.model_id, fb.seq_id, data, fb.loss_fn, fb.loss_fn_config, fb.forward_only


# ---- ForwardBackwardOutput ------------------------------------------------------------------


def encode_forward_backward_output(out: ForwardBackwardOutput) -> bytes:
    arrays = [
        {k: td.to_numpy().astype(_NP_OF_WIRE[td.dtype]) for k, td in o.items()}
        for o in out.loss_fn_outputs
    ]
    return encode_forward_backward_arrays(arrays, out.metrics, out.loss_fn_output_type)


def encode_forward_backward_arrays(
    outputs: list[dict[str, np.ndarray]],
    metrics: dict[str, float],
    output_type: str = "TensorData",
) -> bytes:
    """A ForwardBackwardOutput straight from numpy (float32 / int64 arrays): one ArrayRecord
    per run of datums that share every field's dtype and trailing shape.

    Field names must be the same for all datums: the SDK concatenates records by field name.
    """
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=output_type)
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    if outputs:
        names = sorted(outputs[0])
        for i, o in enumerate(outputs):
            if sorted(o) != names:
                raise ValueError(f"loss_fn_outputs[{i}] has fields {sorted(o)}, expected {names}")
    arrays = [
        {
            k: np.ascontiguousarray(v, dtype="<i8" if v.dtype.kind in "iu" else "<f4")
            for k, v in o.items()
        }
        for o in outputs
    ]

    def signature(i: int) -> tuple:
        return tuple((k, arrays[i][k].dtype.str, arrays[i][k].shape[1:]) for k in sorted(arrays[i]))

    start = 0
    while start < len(arrays):
        end = start + 1
        while end < len(arrays) and signature(end) == signature(start):
            end += 1
        _add_record(msg, arrays[start:end])
        start = end
    return msg.SerializeToString()


def _add_record(msg: pb.ForwardBackwardOutput, run: list[dict[str, np.ndarray]]) -> None:
    record = msg.loss_fn_outputs.add(type_tag="TensorData", num_datums=len(run))
    for name in run[0]:
        parts = [datum[name] for datum in run]
        offsets = np.zeros(len(parts) + 1, dtype="<i8")
        offsets[1:] = np.cumsum([p.nbytes for p in parts])
        bt = record.fields[name]
        bt.data = b"".join(p.tobytes() for p in parts)
        bt.offsets = offsets.tobytes()
        bt.dtype = pb.DTYPE_INT64 if parts[0].dtype.kind == "i" else pb.DTYPE_FLOAT32
        bt.trailing_shape.extend(parts[0].shape[1:])


def decode_forward_backward_output(body: bytes) -> ForwardBackwardOutput:
    """The inverse, read the way the tinker SDK reads it (records concatenated in order)."""
    msg = _parse(pb.ForwardBackwardOutput, body, "ForwardBackwardOutput")
    metrics = {k: float(v) for k, v in msg.metrics.items()}
    outputs: list[dict[str, TensorData]] = []
    for r, record in enumerate(msg.loss_fn_outputs):
        per_datum: list[dict[str, TensorData]] = [{} for _ in range(record.num_datums)]
        for name, bt in record.fields.items():
            field = f"loss_fn_outputs[{r}].fields[{name!r}]"
            if bt.dtype not in _NP_OF_DTYPE:
                raise InvalidRequestError(f"{field}.dtype: unsupported value {bt.dtype}")
            np_dtype = _NP_OF_DTYPE[bt.dtype]
            values = _widen(_frombuffer(bt.data, np_dtype, field), bt.dtype)
            offsets = _frombuffer(bt.offsets, np.dtype("<i8"), f"{field}.offsets")
            if offsets.size != record.num_datums + 1:
                raise InvalidRequestError(
                    f"{field}.offsets: expected {record.num_datums + 1}, got {offsets.size}"
                )
            trailing = list(bt.trailing_shape)
            for i in range(record.num_datums):
                part = values[offsets[i] // np_dtype.itemsize : offsets[i + 1] // np_dtype.itemsize]
                lead = part.size // math.prod(trailing) if math.prod(trailing) else 0
                per_datum[i][name] = _tensor_data(
                    part.reshape([lead, *trailing]), _WIRE_OF_DTYPE[bt.dtype]
                )
        outputs.extend(per_datum)
    output_type = msg.loss_fn_output_type.rsplit(":", 1)[-1] or "TensorData"
    return ForwardBackwardOutput(
        loss_fn_output_type=output_type, loss_fn_outputs=outputs, metrics=metrics
    )


# ---- SampleResponse -------------------------------------------------------------------------


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
    if resp.prompt_logprobs is not None:
        lps = [math.nan if lp is None else lp for lp in resp.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(lps, dtype="<f4").tobytes()
    if resp.topk_prompt_logprobs is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk_to_proto(resp.topk_prompt_logprobs))
    if resp.target_prompt_logprobs is not None:
        msg.target_prompt_logprobs.CopyFrom(tensor_to_proto(resp.target_prompt_logprobs))
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
    )
