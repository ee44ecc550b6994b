"""Splitting a big forward_backward into requests, and joining their outputs back into one.

Chunks get consecutive seq_ids, so the server runs them back to back as if they were one
call. The joined output concatenates the per-datum outputs and reduces each `name:reduction`
metric by its reduction (means and slacks weighted by the chunk's datum count).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treadle.types import Datum, ForwardBackwardOutput

# Defaults of the Tinker client config; the server may send others in /client/config.
MAX_CHUNK_LEN = 1024
MAX_CHUNK_BYTES = 5_000_000


def datum_bytes(datum: Datum) -> int:
    """The size of a datum on the wire (tokens are int32, tensors as declared)."""
    size = 4 * datum.model_input.length
    for tensor in datum.loss_fn_inputs.values():
        size += (8 if tensor.dtype == "int64" else 4) * len(tensor.data)
    return size


def split_chunks(
    data_D: Sequence[Datum], max_len: int = MAX_CHUNK_LEN, max_bytes: int = MAX_CHUNK_BYTES
) -> list[list[Datum]]:
    """Greedy split in order; a single datum over `max_bytes` still gets its own chunk."""
    chunks: list[list[Datum]] = []
    current: list[Datum] = []
    current_bytes = 0
    for datum in data_D:
        size = datum_bytes(datum)
        if current and (len(current) >= max_len or current_bytes + size > max_bytes):
            chunks.append(current)
            current, current_bytes = [], 0
        current.append(datum)
        current_bytes += size
    if current:
        chunks.append(current)
    return chunks


def _reduce(reduction: str, values: list[float], counts: list[int]) -> float | None:
    xs = np.asarray(values, dtype=np.float64)
    if reduction == "sum":
        return float(xs.sum())
    if reduction == "mean":
        return float(np.average(xs, weights=counts))
    if reduction == "min":
        return float(xs.min())
    if reduction == "max":
        return float(xs.max())
    if reduction == "slack":
        return float(xs.max() - np.average(xs, weights=counts))
    if reduction == "hash2":
        return float(sum(int(v) & 0xFFFF_FFFF_FFFF_FFFF for v in values) & 0xFFFF_FFFF_FFFF_FFFF)
    return None


def combine_outputs(outputs: Sequence[ForwardBackwardOutput]) -> ForwardBackwardOutput:
    """Join chunk outputs in order; metrics missing from some chunk are dropped."""
    if len(outputs) == 1:
        return outputs[0]
    counts = [len(o.loss_fn_outputs) for o in outputs]
    metrics: dict[str, float] = {}
    for key in outputs[0].metrics:
        if not all(key in o.metrics for o in outputs):
            continue
        values = [o.metrics[key] for o in outputs]
        reduction = key.rsplit(":", 1)[-1]
        if reduction == "unique":
            # a "unique" metric cannot fold: keep every chunk's value under its own key
            metrics[key] = values[0]
            metrics.update({f"{key}_{i}": v for i, v in enumerate(values[1:], start=1)})
            continue
        reduced = _reduce(reduction, values, counts)
        if reduced is not None:
            metrics[key] = reduced
    return ForwardBackwardOutput(
        loss_fn_output_type=outputs[0].loss_fn_output_type,
        loss_fn_outputs=[row for o in outputs for row in o.loss_fn_outputs],
        metrics=metrics,
    )
