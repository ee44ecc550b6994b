"""ForwardBackwardOutput on the wire: the server encodes it, the SDK decodes it.

The server writes numpy outputs directly (encode_forward_backward_arrays): one ArrayRecord
per run of datums sharing every field's dtype and trailing shape, which the SDK concatenates
by field name. decode_forward_backward_output reads it back as the tinker SDK does.
"""

from __future__ import annotations

import math

import numpy as np

from treadle.errors import InvalidRequestError
from treadle.types import ForwardBackwardOutput, TensorData
from treadle.wire import tinker_pb2 as pb
from treadle.wire.tensors import (
    _NP_OF_DTYPE,
    _NP_OF_WIRE,
    _WIRE_OF_DTYPE,
    _frombuffer,
    _parse,
    _tensor_data,
    _widen,
)


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
