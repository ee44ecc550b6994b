"""The forward_backward request on the wire: the SDK encodes it, the server reads it.

The server parses the protobuf first (parse_forward_backward_request: model_id, seq_id,
forward_only known without touching tensors), then reads it into numpy
(forward_backward_arrays: DatumArrays, each loss input checked against its datum's length
and the request's cell budget), with provenance runs as Span. decode_forward_backward_request
gives wire Datums instead, for tools and tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from treadle.errors import InvalidRequestError
from treadle.types import (
    Datum,
    EncodedTextChunk,
    ModelInput,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
)
from treadle.wire import tinker_pb2 as pb
from treadle.wire.tensors import _frombuffer, _parse, _tensor_data, tensor_array, tensor_to_proto

CUSTOM_LOSS = "custom"  # loss_fn of an uploaded loss (ServiceClient.create_custom_loss)
# Zero-length provenance runs a datum may carry beyond one run per position.
MAX_EMPTY_SPANS = 16


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
    config = loss_config(msg)
    data, budget = [], max_cells
    # a custom loss's inputs may be scalars or of any length (their ranks are the loss's:
    # treadle.engine.loss_graph_spec); every other loss's lead with the model input
    free = msg.loss_fn == CUSTOM_LOSS
    for i, d in enumerate(msg.data):
        datum = _datum_arrays(d, f"data[{i}]", budget, free)
        budget -= sum(a.size for a in datum.loss_fn_inputs.values())
        data.append(datum)
    return ForwardBackwardArrays(
        msg.model_id, int(msg.seq_id), data, msg.loss_fn, config, bool(msg.forward_only)
    )


def loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    """The request's loss_fn_config: loss_fn_config_v2 (numbers and strings) over the
    legacy map (numbers only)."""
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is not None:
            config[key] = value.number if kind == "number" else value.text
    return config


def _datum_arrays(msg: pb.Datum, field: str, max_cells: int, free: bool = False) -> DatumArrays:
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
        lead = None if free and key != "target_tokens" else len(tokens)
        inputs[key] = tensor_array(t, where, lead=lead, max_cells=max_cells)
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
