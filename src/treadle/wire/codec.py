"""Protobuf ⇄ treadle.types for the Tinker wire format (SDK 0.38), in both directions.

The server decodes forward_backward requests and encodes ForwardBackwardOutput and
SampleResponse results; the treadle SDK does the opposite, with the same functions.
Byte fields hold little-endian numpy `.tobytes()` data (see tinker.proto).

Anything malformed raises InvalidRequestError with a message naming the field, so that the
server can answer 400 without touching the engine.

The codecs live by message, and every public name is importable from here too: tensors
(Tensor and the byte-level helpers), forward_backward_request, forward_backward_output,
sample_response.
"""

from __future__ import annotations

from treadle.wire.forward_backward_output import (
    decode_forward_backward_output,
    encode_forward_backward_arrays,
    encode_forward_backward_output,
)
from treadle.wire.forward_backward_request import (
    MAX_EMPTY_SPANS,
    DatumArrays,
    ForwardBackwardArrays,
    Span,
    decode_forward_backward_request,
    encode_forward_backward_request,
    forward_backward_arrays,
    loss_config,
    parse_forward_backward_request,
)
from treadle.wire.sample_response import (
    TOPK_EMPTY_ID,
    TOPK_EMPTY_LOGPROB,
    decode_sample_response,
    encode_sample_response,
)
from treadle.wire.tensors import tensor_array, tensor_from_proto, tensor_to_proto

__all__ = [
    "MAX_EMPTY_SPANS",
    "TOPK_EMPTY_ID",
    "TOPK_EMPTY_LOGPROB",
    "DatumArrays",
    "ForwardBackwardArrays",
    "Span",
    "decode_forward_backward_output",
    "decode_forward_backward_request",
    "decode_sample_response",
    "encode_forward_backward_arrays",
    "encode_forward_backward_output",
    "encode_forward_backward_request",
    "encode_sample_response",
    "forward_backward_arrays",
    "loss_config",
    "parse_forward_backward_request",
    "tensor_array",
    "tensor_from_proto",
    "tensor_to_proto",
]
