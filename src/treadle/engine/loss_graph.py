"""Server-side custom losses: an uploaded loss graph (checked by treadle.engine.loss_graph_spec)
run over torch ops from an allow-list, once per datum, inside the training pass.

The SDK's semantics (`ServiceClient.create_custom_loss`): the loss runs once per datum on
that datum's target logprobs (shaped like its target_tokens) and the loss_fn_inputs it
reads; the datums' losses are summed; a metric `custom/x:sum` adds up over datums and
`custom/x:mean` is their mean. Run here on the logprobs of the same forward pass that the
backward goes through, a custom loss costs one engine call: the client-side path
(`forward`, the loss on the client, then `forward_backward` with its gradients as weights)
costs two, and gives the same loss and gradients (tests/engine/test_loss_graph.py).

Cost: a call is rebuilt from FUNCTIONS (no matrix products, no size arguments), and before
a graph touches real tensors it runs on meta tensors of the same shapes (shapes only,
nothing allocated), so that an intermediate that would grow past MAX_NODE_CELLS_FACTOR
times the datum's largest tensor, or all of them together past MAX_TOTAL_CELLS_FACTOR
times its inputs, is refused before it exists (`check_cost`).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.fx.node import _get_qualified_name

from treadle.engine.loss_graph_spec import (
    ALLOWED_FUNCTIONS,
    ALLOWED_METHODS,
    Const,
    LossGraph,
    Node,
    Ref,
    input_array,
    parse_upload,
)
from treadle.engine.types import TrainDatum
from treadle.errors import InvalidRequestError

# An intermediate may hold this many times the cells of the datum's largest input, plus
# SLACK_CELLS; all of a datum's intermediates together this many times its inputs.
MAX_NODE_CELLS_FACTOR = 4
MAX_TOTAL_CELLS_FACTOR = 128
SLACK_CELLS = 4096


def _function_table() -> dict[str, Any]:
    """Qualified name (as the SDK sends it) → the callable, for every allowed function."""
    table: dict[str, Any] = {}
    for name in ALLOWED_FUNCTIONS:
        module, _, attr = name.rpartition(".")
        root = {"torch": torch, "math": math, "operator": operator}[module.split(".")[0]]
        obj: Any = root
        for part in [*module.split(".")[1:], attr]:
            obj = getattr(obj, part, None)
        if obj is not None:
            table[name] = obj
    # what this torch calls them, in case the SDK's torch names one differently
    for fn in list(table.values()):
        try:
            table.setdefault(_get_qualified_name(fn).replace("_operator.", "operator."), fn)
        except (RuntimeError, AttributeError):
            pass
    table["getattr"] = table["builtins.getattr"] = getattr
    return table


FUNCTIONS = _function_table()
_DTYPES = {"float16", "bfloat16", "float32", "float64", "int32", "int64", "bool"}


def _value(arg: Any, env: dict[str, Any], device: torch.device) -> Any:
    if isinstance(arg, Ref):
        return env[arg.name]
    if isinstance(arg, Const):
        if arg.kind == "dtype" and arg.value in _DTYPES:
            return getattr(torch, arg.value)
        if arg.kind == "device":
            return device  # every loss runs where its logprobs are
        if arg.kind == "layout":
            return torch.strided
        return torch.preserve_format
    if isinstance(arg, list):
        return [_value(a, env, device) for a in arg]
    if isinstance(arg, tuple):
        return tuple(_value(a, env, device) for a in arg)
    if isinstance(arg, dict):
        return {k: _value(v, env, device) for k, v in arg.items()}
    if isinstance(arg, slice):
        return slice(*(_value(a, env, device) for a in (arg.start, arg.stop, arg.step)))
    return arg


def _call(node: Node, env: dict[str, Any], device: torch.device) -> Any:
    args = [_value(a, env, device) for a in node.args]
    kwargs = {k: _value(v, env, device) for k, v in node.kwargs.items()}
    if node.op == "call_function":
        fn = FUNCTIONS.get(node.target)
        if fn is None:  # the spec allows it, this torch has no such function
            raise InvalidRequestError(f"node {node.name}: {node.target!r} is not available here")
        if fn in (torch.tensor, torch.scalar_tensor):
            kwargs["device"] = device
        return fn(*args, **kwargs)
    this = args[0]
    if not isinstance(this, torch.Tensor) or node.target not in ALLOWED_METHODS:
        raise InvalidRequestError(f"node {node.name}: method {node.target!r} needs a tensor")
    return getattr(this, node.target)(*args[1:], **kwargs)


def run(
    graph: LossGraph, values: list[torch.Tensor], on_value: Any = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and metrics of one datum: `values` are its logprobs, then its inputs, in
    the order the graph declared them. `on_value(node, value)` sees every result."""
    device = values[0].device
    env: dict[str, Any] = {}
    placeholders = iter(values)
    out: Any = None
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node.name] = next(placeholders)
        elif node.op == "output":
            out = _value(node.args[0], env, device)
        else:
            try:
                env[node.name] = _call(node, env, device)
            except InvalidRequestError:
                raise
            except Exception as e:  # a shape or dtype the op refuses: the loss's own error
                raise InvalidRequestError(
                    f"custom loss {graph.name!r}, node {node.name} ({node.target}): "
                    f"{type(e).__name__}: {e}"
                ) from e
            if on_value is not None:
                on_value(node, env[node.name])
    loss, metrics = out
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InvalidRequestError(f"custom loss {graph.name!r} must return a scalar, got {shape}")
    for key, value in metrics.items():
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise InvalidRequestError(
                f"custom loss {graph.name!r}: metric {key!r} must be a one-element tensor"
            )
    return loss, metrics


def check_cost(graph: LossGraph, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Run the graph on meta tensors of these shapes (logprobs first): refuse it, naming the
    node, if any intermediate (or all of them) would hold too many cells."""
    cells = [math.prod(s) for s, _ in shapes]
    per_node = MAX_NODE_CELLS_FACTOR * max(cells) + SLACK_CELLS
    total_cap = MAX_TOTAL_CELLS_FACTOR * sum(cells) + SLACK_CELLS
    total = [0]

    def watch(node: Node, value: Any) -> None:
        for t in value if isinstance(value, tuple | list) else (value,):
            if not isinstance(t, torch.Tensor):
                continue
            total[0] += t.numel()
            if t.numel() > per_node or total[0] > total_cap:
                raise InvalidRequestError(
                    f"custom loss {graph.name!r}, node {node.name} ({node.target}): a tensor "
                    f"of {t.numel()} cells ({total[0]} in all so far) is over this server's "
                    f"bound for inputs of {max(cells)} cells ({per_node} per node, "
                    f"{total_cap} in all)"
                )

    meta = [torch.empty(s, dtype=d, device="meta") for s, d in shapes]
    try:
        run(graph, meta, watch)
    except NotImplementedError as e:  # an op whose output size depends on the values
        raise InvalidRequestError(
            f"custom loss {graph.name!r}: its cost cannot be bounded before it runs ({e})"
        ) from e


class CustomLoss:
    """One batch's custom loss in the training pass (the hook of treadle.engine.train's
    `_batch_loss`): each datum's loss in its row's first cell of a per-token tensor, so that
    the trainer's masked sum is the sum of the datums' losses."""

    def __init__(self, graph: LossGraph):
        self.graph = graph
        self._checked: set[tuple] = set()  # shape signatures whose cost was checked

    def datum_values(
        self, datum: TrainDatum, lp: torch.Tensor, device: torch.device
    ) -> list[torch.Tensor]:
        values = [lp]
        for key, rank in self.graph.inputs[1:]:
            arr = input_array(datum.loss_inputs[key], rank)
            dtype = torch.float32 if arr.dtype.kind == "f" else torch.int64
            values.append(torch.tensor(arr, dtype=dtype, device=device))  # a copy: arr is read-only
        return values

    def checked(self, values: list[torch.Tensor]) -> None:
        signature = tuple((tuple(v.shape), v.dtype) for v in values)
        if signature not in self._checked:
            check_cost(self.graph, [(tuple(v.shape), v.dtype) for v in values])
            self._checked.add(signature)

    def per_token(
        self, lp: torch.Tensor, data: list[TrainDatum], sent: list[np.ndarray]
    ) -> torch.Tensor:
        """lp: the batch's target logprobs (n, T) or (n, T, K) → (n, T[, K]) with datum i's
        loss at [i, 0(, 0)] and zeros elsewhere."""
        losses = []
        for i, (datum, targets) in enumerate(zip(data, sent, strict=True)):
            if targets.ndim == 2:
                lp_i = lp[i, : targets.shape[0], : targets.shape[1]]  # (T_i, K_i)
            elif lp.dim() == 3:
                lp_i = lp[i, : targets.shape[0], 0]  # (T_i,): a (T,) datum in a top-K batch
            else:
                lp_i = lp[i, : targets.shape[0]]  # (T_i,)
            values = self.datum_values(datum, lp_i, lp.device)
            self.checked(values)
            loss, _ = run(self.graph, values)
            losses.append(loss.to(lp.dtype))
        stacked = torch.stack(losses)  # (n,)
        if lp.dim() == 3:
            return F.pad(stacked[:, None, None], (0, lp.shape[2] - 1, 0, lp.shape[1] - 1))
        return F.pad(stacked[:, None], (0, lp.shape[1] - 1))  # (n, T)

    def metrics(self, data: list[TrainDatum], logprobs: list[np.ndarray]) -> dict[str, float]:
        """The loss's metrics over the datums, from the logprobs the pass returned (what the
        SDK reports: `:sum` metrics summed over datums, `:mean` ones averaged)."""
        sums: dict[str, float] = {}
        with torch.no_grad():
            for datum, lp in zip(data, logprobs, strict=True):
                values = self.datum_values(datum, torch.as_tensor(lp), torch.device("cpu"))
                self.checked(values)
                _, metrics = run(self.graph, values)
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value.detach().float().reshape(()))
        return {k: v / len(data) if k.endswith(":mean") else v for k, v in sums.items()}


@functools.lru_cache(maxsize=64)
def custom_loss(upload: str) -> CustomLoss:
    """An upload as a train op carries it (JSON: name, inputs, graph) → its CustomLoss.
    Kept per upload, so that a loop's every step does not parse and check its graph again
    on the engine thread, nor dry-run the cost of shapes it has seen."""
    return CustomLoss(parse_upload(upload))
