"""Tensors on the Tinker wire, and the byte-level helpers every message of treadle.wire uses.

A Tensor is dense little-endian bytes or sparse CSR; tensor_array reads either into numpy,
checking its declared sizes before anything is allocated (a CSR tensor declares its shape in
a few bytes). bf16 and int32 are widened to the public wire's float32 and int64. _parse,
_frombuffer and _widen raise InvalidRequestError naming the field, for every message.
"""

from __future__ import annotations

import math

import numpy as np
from google.protobuf.message import DecodeError

from treadle.errors import InvalidRequestError
from treadle.types import TensorData
from treadle.wire import tinker_pb2 as pb

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
