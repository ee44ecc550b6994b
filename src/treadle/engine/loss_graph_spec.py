"""What a server-side custom loss may be: the traced graph the tinker SDK uploads with
`ServiceClient.create_custom_loss`, read into plain data and checked, without torch (the API
process checks an upload at its edge with this module; the engine reads the same data and
runs it, treadle.engine.loss_graph).

A graph is torch.fx's node list as the SDK encodes it (`CustomLossGraph`, format 1): its
placeholders (`logprobs`, then one per loss_fn_inputs key the loss reads), calls, and one
output `(loss, {metric: tensor})`. Nothing in it runs until the engine rebuilds each call
from its own table, so the checks here are what a call may name:

- a node's op is `placeholder`, `call_function`, `call_method` or `output` (never a module
  call or a captured tensor: `call_module`, `get_attr`);
- a function is one of ALLOWED_FUNCTIONS (elementwise math, reductions, comparisons,
  indexing and shape ops over torch, math and operator), a method one of ALLOWED_METHODS,
  `getattr` reads only `shape`, `ndim` or `dtype`; anything else is refused naming the node
  and its target;
- the graph is a DAG in execution order: a node refers only to nodes before it (a reference
  to itself or to a later node, a cycle, is refused), names are unique, and there are at most
  MAX_NODES nodes, MAX_ARGS encoded values in a node's arguments, nested MAX_DEPTH deep.

There is no matrix product, no einsum and no tensor constructor that takes a size, so a
loss costs O(nodes x the largest tensor); the engine also runs each graph on meta tensors
(shapes only) before any real allocation and refuses one whose intermediates grow past a
bound (treadle.engine.loss_graph.check_cost).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treadle.engine.specs import MAX_ABS_LOSS_VALUE, MAX_TOPK_COLUMNS, _int_array, check_ids
from treadle.engine.types import TrainDatum
from treadle.errors import InvalidRequestError

FORMAT = 1
MAX_NODES = 512
MAX_ARGS = 256  # encoded values in one node's args and kwargs, nested ones counted
MAX_DEPTH = 6
MAX_INPUTS = 16  # logprobs included (the SDK's own bound)
MAX_NAME_CHARS = 128
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")

# Qualified names as torch.fx records them (`torch.fx.node._get_qualified_name`; Python
# operators under `operator.`, as the SDK sends them). The engine maps each to its callable.
_TORCH = (
    # elementwise
    "abs", "neg", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt",
    "square", "sigmoid", "tanh", "relu", "sign", "floor", "ceil", "round", "trunc",
    "clamp", "clip", "clamp_min", "clamp_max", "minimum", "maximum", "where", "pow",
    "add", "sub", "mul", "div", "true_divide", "reciprocal", "lerp", "logaddexp",
    "nan_to_num", "isfinite", "isnan", "logical_and", "logical_or", "logical_not",
    "lt", "le", "gt", "ge", "eq", "ne", "masked_fill", "detach",
    # reductions
    "sum", "mean", "prod", "amax", "amin", "max", "min", "logsumexp", "cumsum", "norm",
    "count_nonzero", "dot", "softmax", "log_softmax",
    # indexing and shape
    "gather", "index_select", "cat", "stack", "flatten", "reshape", "squeeze", "unsqueeze",
    "transpose", "narrow", "select",
    # tensors shaped like an input (no size argument)
    "zeros_like", "ones_like", "full_like", "tensor", "scalar_tensor",
)  # fmt: skip
_NN = ("log_sigmoid", "softplus")  # torch._C._nn
_FUNCTIONAL = ("relu", "silu", "gelu", "log_softmax", "softmax", "logsigmoid", "softplus")
_MATH = ("log", "exp", "sqrt", "log1p", "expm1", "tanh", "fabs", "pow")
_OPERATOR = (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs",
    "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "invert", "getitem",
)  # fmt: skip
ALLOWED_FUNCTIONS = frozenset(
    [f"torch.{n}" for n in _TORCH]
    + [f"torch._C._nn.{n}" for n in _NN]
    + [f"torch.nn.functional.{n}" for n in _FUNCTIONAL]
    + [f"math.{n}" for n in _MATH]
    + [f"operator.{n}" for n in _OPERATOR]
)
ALLOWED_METHODS = frozenset(
    {
        *("abs", "neg", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "square", "sigmoid"),
        *("tanh", "relu", "sign", "floor", "ceil", "round", "clamp", "clip", "clamp_min"),
        *("clamp_max", "pow", "add", "sub", "mul", "div", "reciprocal", "masked_fill"),
        *("lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or", "logical_not"),
        *("sum", "mean", "prod", "amax", "amin", "max", "min", "logsumexp", "cumsum", "norm"),
        *("softmax", "log_softmax", "gather", "index_select", "flatten", "reshape", "view"),
        *("squeeze", "unsqueeze", "transpose", "narrow", "select", "detach", "float"),
        *("double", "long", "int", "bool", "type_as", "size", "dim", "numel", "clone"),
        *("contiguous", "nan_to_num", "isfinite", "isnan", "where", "t", "dot"),
    }
)
GETATTRS = frozenset({"shape", "ndim", "dtype"})
DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "int32", "int64", "bool"})
OPS = ("placeholder", "call_function", "call_method", "output")


@dataclass(frozen=True)
class Ref:
    """An argument that is an earlier node's value."""

    name: str


@dataclass(frozen=True)
class Const:
    """A torch constant argument (a dtype; a device, layout or memory format: the engine
    runs every loss on its own device and layout whatever the client traced with)."""

    kind: str
    value: str


@dataclass(frozen=True)
class Node:
    op: str  # placeholder | call_function | call_method | output
    name: str
    target: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LossGraph:
    """An uploaded loss, checked: `inputs` are (name, rank) pairs, `logprobs` first."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    nodes: tuple[Node, ...]
    metrics: tuple[str, ...]  # the output's metric keys, in order

    @property
    def input_names(self) -> tuple[str, ...]:
        """The loss_fn_inputs keys it reads (after logprobs), in order."""
        return tuple(name for name, _ in self.inputs[1:])

    @property
    def logprobs_rank(self) -> int:
        return self.inputs[0][1]


def parse_graph(name: str, inputs: list[Any], graph: Any) -> LossGraph:
    """A create_custom_loss upload (its name, inputs and encoded graph, as JSON values) →
    a LossGraph; InvalidRequestError naming what is wrong otherwise."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS:
        raise InvalidRequestError(f"name: expected 1 to {MAX_NAME_CHARS} characters, got {name!r}")
    declared = _inputs(inputs)
    if not isinstance(graph, dict) or graph.get("format", FORMAT) != FORMAT:
        raise InvalidRequestError(f"graph.format: only format {FORMAT} is understood")
    raw = graph.get("nodes")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("graph.nodes: expected a non-empty list of nodes")
    if len(raw) > MAX_NODES:
        raise InvalidRequestError(
            f"graph.nodes: {len(raw)} nodes exceed the limit of {MAX_NODES} per custom loss"
        )
    nodes: list[Node] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        node = _node(item, i, seen)
        nodes.append(node)
        seen.add(node.name)
    placeholders = [n.target for n in nodes if n.op == "placeholder"]
    if placeholders != [n for n, _ in declared]:
        raise InvalidRequestError(
            f"graph: its placeholders {placeholders} must be the declared inputs "
            f"{[n for n, _ in declared]}, in order"
        )
    if nodes[-1].op != "output" or sum(n.op == "output" for n in nodes) != 1:
        raise InvalidRequestError("graph: expected exactly one output node, the last")
    metrics = _check_output(nodes[-1])
    return LossGraph(name, declared, tuple(nodes), metrics)


def upload_text(name: str, inputs: list[Any], graph: Any) -> str:
    """An upload as ops carry it and the database keeps it (JSON)."""
    return json.dumps({"name": name, "inputs": inputs, "graph": graph}, separators=(",", ":"))


def parse_upload(text: str) -> LossGraph:
    """`upload_text`'s JSON → its LossGraph (checked again: it is read from an op)."""
    try:
        upload = json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(f"custom loss: its upload is not JSON ({e})") from e
    return parse_graph(upload.get("name"), upload.get("inputs"), upload.get("graph"))


def _inputs(inputs: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_INPUTS:
        raise InvalidRequestError(f"inputs: expected 1 to {MAX_INPUTS} inputs, logprobs first")
    out = []
    for i, item in enumerate(inputs):
        name = item.get("name") if isinstance(item, dict) else None
        rank = item.get("rank") if isinstance(item, dict) else None
        if not isinstance(name, str) or not INPUT_NAME.fullmatch(name):
            raise InvalidRequestError(f"inputs[{i}].name: expected a lowercase name, got {name!r}")
        if rank not in (0, 1, 2) or isinstance(rank, bool):
            raise InvalidRequestError(f"inputs[{i}].rank: expected 0, 1 or 2, got {rank!r}")
        out.append((name, int(rank)))
    if out[0][0] != "logprobs" or out[0][1] == 0:
        raise InvalidRequestError("inputs[0]: must be logprobs, of rank 1 ([T]) or 2 ([T, K])")
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"inputs: names must be unique, got {names}")
    if "target_tokens" in names:
        raise InvalidRequestError("inputs: target_tokens is what logprobs are taken of")
    return tuple(out)


def _node(item: Any, i: int, seen: set[str]) -> Node:
    where = f"graph.nodes[{i}]"
    if not isinstance(item, dict):
        raise InvalidRequestError(f"{where}: expected an object")
    op, name, target = item.get("op"), item.get("name"), item.get("target")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequestError(f"{where}.name: expected an identifier, got {name!r}")
    if name in seen:
        raise InvalidRequestError(f"{where}.name: {name!r} is used twice")
    where = f"{where} ({name})"
    if op not in OPS:
        raise InvalidRequestError(
            f"{where}: op {op!r} is not allowed in a custom loss (allowed: {list(OPS)}; a "
            "loss may not call modules or capture tensors)"
        )
    if not isinstance(target, str) or len(target) > 256:
        raise InvalidRequestError(f"{where}.target: expected a name, got {target!r}")
    if (
        op == "call_function"
        and target not in ALLOWED_FUNCTIONS
        and target
        not in (
            "getattr",
            "builtins.getattr",
        )
    ):
        raise InvalidRequestError(
            f"{where}: function {target!r} is not allowed in a server-side custom loss "
            "(elementwise math, reductions, comparisons, indexing and shape ops of torch, "
            "math and operator are; see docs/training.md)"
        )
    if op == "call_method" and target not in ALLOWED_METHODS:
        raise InvalidRequestError(
            f"{where}: method {target!r} is not allowed in a server-side custom loss"
        )
    budget = [MAX_ARGS]
    args = item.get("args", [])
    kwargs = item.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise InvalidRequestError(f"{where}: args must be a list and kwargs an object")
    decoded = tuple(_arg(a, where, seen, budget, 0) for a in args)
    decoded_kw = {str(k): _arg(v, where, seen, budget, 0) for k, v in kwargs.items()}
    if op == "call_method" and not (decoded and isinstance(decoded[0], Ref)):
        raise InvalidRequestError(f"{where}: a method call needs a tensor to call it on")
    if op == "call_function" and target.endswith("getattr"):
        attr = decoded[1] if len(decoded) == 2 else None
        if attr not in GETATTRS or not isinstance(decoded[0], Ref):
            raise InvalidRequestError(
                f"{where}: getattr reads only {sorted(GETATTRS)} of a tensor, got {attr!r}"
            )
    if op == "placeholder" and (decoded or decoded_kw):
        raise InvalidRequestError(f"{where}: a placeholder takes no arguments")
    return Node(op, name, target, decoded, decoded_kw)


def _arg(value: Any, where: str, seen: set[str], budget: list[int], depth: int) -> Any:
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        raise InvalidRequestError(
            f"{where}: arguments exceed {MAX_ARGS} values or nest deeper than {MAX_DEPTH}"
        )
    if value is None or isinstance(value, bool | int | str):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**62:
            raise InvalidRequestError(f"{where}: integer argument {value} is out of range")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequestError(f"{where}: float arguments must be finite or tagged")
        return value
    if isinstance(value, list):
        return [_arg(v, where, seen, budget, depth + 1) for v in value]
    if not isinstance(value, dict) or len(value) != 1:
        raise InvalidRequestError(f"{where}: cannot read argument {value!r}")
    (tag, inner), = value.items()  # fmt: skip
    if tag == "ref":
        if not isinstance(inner, str) or inner not in seen:
            raise InvalidRequestError(
                f"{where}: refers to {inner!r}, which is not an earlier node (a graph must be "
                "acyclic, each node after the nodes it reads)"
            )
        return Ref(inner)
    if tag == "tuple" and isinstance(inner, list):
        return tuple(_arg(v, where, seen, budget, depth + 1) for v in inner)
    if tag == "dict" and isinstance(inner, dict):
        return {str(k): _arg(v, where, seen, budget, depth + 1) for k, v in inner.items()}
    if tag == "slice" and isinstance(inner, list) and len(inner) == 3:
        parts = [_arg(v, where, seen, budget, depth + 1) for v in inner]
        return slice(*parts)
    if tag == "ellipsis":
        return Ellipsis
    if tag == "float" and inner in ("inf", "-inf", "nan"):
        return float(inner)
    if tag == "dtype" and inner in DTYPES:
        return Const("dtype", inner)
    if tag in ("device", "layout", "memory_format") and isinstance(inner, str):
        return Const(tag, inner)
    raise InvalidRequestError(f"{where}: argument {value!r} is not allowed in a custom loss")


def _check_output(node: Node) -> tuple[str, ...]:
    out = node.args[0] if len(node.args) == 1 else None
    if not (isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[0], Ref)):
        raise InvalidRequestError("graph: the output must be (loss, metrics), the loss a tensor")
    metrics = out[1]
    if not isinstance(metrics, dict):
        raise InvalidRequestError("graph: the output's metrics must be a dict")
    for key, value in metrics.items():
        if not METRIC_KEY.fullmatch(key) or not isinstance(value, Ref):
            raise InvalidRequestError(
                f"graph: metric {key!r} must be named custom/<name>:sum or custom/<name>:mean "
                "and be a tensor"
            )
    return tuple(metrics)


# ---- the datums of a forward_backward with a custom loss ----------------------------------


def input_array(value: np.ndarray, rank: int) -> np.ndarray:
    """A datum's loss input as the loss sees it: a scalar arrives as one value without a
    shape (the wire cannot tell () from (1,) apart), so rank 0 takes a single value."""
    arr = np.asarray(value)
    return arr.reshape(()) if rank == 0 and arr.size == 1 else arr


def validate_custom_batch(
    graph: LossGraph,
    data: list[TrainDatum],
    vocab_size: int,
    max_seq_len: int,
    where: str = "data[{i}].",
) -> None:
    """Each datum has tokens in the vocabulary, target_tokens of the rank logprobs was
    declared with, and every input the loss reads at its declared rank, finite and within
    ±MAX_ABS_LOSS_VALUE; keys the loss does not read are ignored (the SDK sends a datum's
    inputs unchanged)."""
    if not data:
        raise InvalidRequestError("data must hold at least one datum, got an empty list")
    want = graph.logprobs_rank
    for i, datum in enumerate(data):
        at = where.format(i=i)
        tokens = _int_array(datum.tokens, at + "model_input")
        if tokens.ndim != 1 or not 1 <= tokens.shape[0] <= max_seq_len:
            raise InvalidRequestError(
                f"{at}model_input has shape {tokens.shape}, expected (T,) with "
                f"1 <= T <= {max_seq_len}"
            )
        check_ids(tokens, vocab_size, at + "model_input")
        inputs = datum.loss_inputs
        if "target_tokens" not in inputs:
            raise InvalidRequestError(f"{at}loss_fn_inputs is missing 'target_tokens'")
        name = at + "loss_fn_inputs['target_tokens']"
        targets = _int_array(inputs["target_tokens"], name)
        T = tokens.shape[0]
        ok = targets.shape[:1] == (T,) and targets.ndim == want
        if want == 2:
            ok = ok and 1 <= targets.shape[1] <= MAX_TOPK_COLUMNS
        if not ok:
            expected = f"({T},)" if want == 1 else f"({T}, K), K <= {MAX_TOPK_COLUMNS}"
            raise InvalidRequestError(
                f"{name} has shape {targets.shape}, expected {expected}: loss "
                f"{graph.name!r} declared logprobs with rank {want}"
            )
        check_ids(targets, vocab_size, name)
        for key, rank in graph.inputs[1:]:
            if key not in inputs:
                raise InvalidRequestError(
                    f"{at}loss_fn_inputs is missing {key!r}, which loss {graph.name!r} reads"
                )
            value = input_array(inputs[key], rank)
            if value.ndim != rank:
                raise InvalidRequestError(
                    f"{at}loss_fn_inputs[{key!r}] has shape {value.shape}, but loss "
                    f"{graph.name!r} declared it with rank {rank}"
                )
            if not np.issubdtype(value.dtype, np.number) or not np.isfinite(value).all():
                raise InvalidRequestError(f"{at}loss_fn_inputs[{key!r}] must hold finite numbers")
            if value.size and np.abs(value).max() > MAX_ABS_LOSS_VALUE:
                raise InvalidRequestError(
                    f"{at}loss_fn_inputs[{key!r}] must lie within ±{MAX_ABS_LOSS_VALUE:g}"
                )
