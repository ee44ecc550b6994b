"""One frozen base model, many LoRA adapters, each batch row routed to its own adapter.

peft can mix adapters in one batch only for inference, so the engine has its own LoRA:
every targeted nn.Linear gets a forward that adds `scale * B(A(x))` of each row's adapter.
The module tree and the base weights stay untouched (tied embeddings included), and an
adapter costs only its A/B tensors (plus optimizer state while it trains).

Routing contract (the trainer and the sampler both rely on it):

    with bank.rows(["sess-1", "sess-1", "snap-7", None]):
        logits = model(input_ids).logits      # row 0,1: adapter sess-1; row 2: snapshot; row 3: base

A key is a live adapter id, a snapshot id or None (the base model). Within one model call
each LoRA layer serves all adapters, forward and backward:
- one adapter for every row: plain `out + scale * B(A(x))`, no indexing at all; or, when
  the rank is high for the layer's size and the call has many tokens, one matmul with the
  merged weight `W + scale * B A` instead of the base matmul plus the low-rank product
  (merge_is_cheaper states when, from FLOPs); differentiable in A and B like the product;
- many tokens per row (training, prefill): the input is split into the contiguous rows of
  each adapter (permuted first when an adapter's rows are scattered), one matmul pair per
  adapter, the updates concatenated: linear in the batch size;
- a few tokens per row (decoding): all adapters' A stacked along the rank, one matmul, each
  row keeps its own rank slice, one matmul with the B's stacked the same way.
Rows without a LoRA on a layer add an exact zero, so a fresh adapter (B = 0) is the base.
Inside one rows() context under no_grad the stacked weights are reused across calls:
do not change adapter weights in place inside such a context.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from treadle.engine.types import LoraSpec
from treadle.errors import ConflictError, InvalidRequestError, NotFoundError

ATTN, MLP, UNEMBED = "attn", "mlp", "unembed"
_ATTN_PARTS = ("attn", "attention")
_MLP_PARTS = ("mlp", "feed_forward", "ffn")


@dataclass
class LoraPair:
    """The update of one nn.Linear: W x + scale * B (A x)."""

    A: torch.Tensor  # (r, in)
    B: torch.Tensor  # (out, r)
    scale: float


@dataclass
class Adapter:
    """A live adapter (nn.Parameters that train) or a snapshot (detached frozen tensors)."""

    id: str
    spec: LoraSpec
    layers: dict[str, LoraPair]  # module path -> pair, sorted by path
    trainable: bool
    extra: dict = field(default_factory=dict)  # free slot for the trainer (optimizer, step)

    def parameters(self) -> list[torch.Tensor]:
        """A and B of each module, in module-path order (the order optimizer state uses)."""
        out: list[torch.Tensor] = []
        for pair in self.layers.values():
            out += [pair.A, pair.B]
        return out

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


@dataclass
class _Route:
    """How the rows of the next model calls map to adapters.

    Rows are cut into contiguous segments of one key each (after a permutation when a key's
    rows are scattered), so each LoRA layer splits its input once, runs one small matmul pair
    per segment and concatenates: forward and backward stay linear in the batch size.
    """

    n_rows: int
    whole: Adapter | None  # set when every row uses this one adapter (no indexing)
    segments: list[tuple[Adapter | None, int]]  # (adapter or None for base, rows), in order
    perm: torch.Tensor | None = None  # (B,) row order that makes segments contiguous
    inverse: torch.Tensor | None = None  # (B,) undoes perm
    slots: torch.Tensor | None = None  # (B,) segment index of each row
    cache: dict = field(default_factory=dict)  # per-route constants of _concat_delta


# Few tokens per row (decoding): all adapters in one matmul pair (_concat_delta) beats a
# matmul pair per adapter; with many tokens per row the extra FLOPs would not pay. Such calls
# also never merge (see merge_is_cheaper): decoding keeps the low-rank product.
CONCAT_MAX_TOKENS = 8


def merge_is_cheaper(
    n_tokens: int, n_in: int, n_out: int, rank: int, grad_weights: bool, grad_input: bool
) -> bool:
    """Whether `x @ (W + s B A)^T` costs fewer FLOPs than `x W^T + s (x A^T) B^T`.

    Multiply-adds of one layer call over N tokens, io = in*out, lo = rank*(in+out):
    - forward: unmerged N*io + N*lo; merged r*io (B @ A) + N*io;
    - input gradient: N*io both, plus N*lo for the product (dY B, then dH A);
    - A/B gradients: the product needs dY B (if not already done), dY^T H and dH^T x; the
      merged path needs dW = dY^T x (N*io) and then B^T dW, dW A^T (2 r*io).
    Forward only this is N > io / (in+out): a token count, whatever the rank. Training (both
    gradients) it is N * (3 lo - io) > 3 r io: for long batches rank*(in+out) > in*out / 3.
    The merged weight kept for backward is one layer's size, less than the adapter's A, B,
    their gradients and AdamW moments (4 lo) whenever training merges (3 lo > io).
    """
    io, lo = n_in * n_out, rank * (n_in + n_out)
    unmerged = n_tokens * (io + lo)
    merged = rank * io + n_tokens * io
    if grad_input:
        unmerged += n_tokens * (io + rank * n_in)
        merged += n_tokens * io
    if grad_input or grad_weights:
        unmerged += n_tokens * rank * n_out
    if grad_weights:
        unmerged += n_tokens * lo
        merged += n_tokens * io + 2 * rank * io
    return merged < unmerged


def classify_linear_modules(model: nn.Module) -> dict[str, str]:
    """Module path -> ATTN | MLP | UNEMBED for every nn.Linear LoRA may target.

    Attention and MLP projections are recognised by a parent named like `self_attn` / `mlp`,
    which covers Llama, Qwen, Mistral and Gemma; the unembedding is get_output_embeddings().
    """
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if module is out_emb:
            found[name] = UNEMBED
            continue
        parents = name.split(".")[:-1]
        if any(any(p in part for p in _ATTN_PARTS) for part in parents):
            found[name] = ATTN
        elif any(any(p in part for p in _MLP_PARTS) for part in parents):
            found[name] = MLP
    return dict(sorted(found.items()))


def init_lora_a(A: torch.Tensor, generator: torch.Generator) -> None:
    """PEFT's default init of lora_A (kaiming-uniform, a=sqrt(5)), from our own generator."""
    nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)


class AdapterBank:
    """Adapters and snapshots of one base model, and the row routing of its LoRA layers."""

    def __init__(
        self,
        model: nn.Module,
        param_dtype: torch.dtype = torch.float32,
        merge_when_cheaper: bool = True,
    ):
        self.model = model
        self.param_dtype = param_dtype  # adapters train in fp32 even on a bf16 base
        # False keeps every single-adapter call on the low-rank product (the reference path)
        self.merge_when_cheaper = merge_when_cheaper
        self.modules: dict[str, nn.Module] = dict(model.named_modules())
        self.targets = classify_linear_modules(model)
        self.adapters: dict[str, Adapter] = {}
        self.snapshots: dict[str, Adapter] = {}
        self._hooked: dict[str, nn.Linear] = {}  # paths whose forward is ours
        self._route: _Route | None = None

    # ---- adapters ----
    def target_paths(self, spec: LoraSpec) -> list[str]:
        wanted = {ATTN: spec.train_attn, MLP: spec.train_mlp, UNEMBED: spec.train_unembed}
        return [path for path, kind in self.targets.items() if wanted[kind]]

    def create(self, adapter_id: str, spec: LoraSpec) -> Adapter:
        """A fresh adapter: A kaiming-uniform from spec.seed, B zero, so it equals the base."""
        _check_spec(spec)
        paths = self.target_paths(spec)
        if not paths:
            raise InvalidRequestError(
                "lora spec trains nothing: set at least one of train_attn, train_mlp, "
                f"train_unembed to true (got {spec.train_attn}, {spec.train_mlp}, "
                f"{spec.train_unembed}), or this model has no such layers"
            )
        gen = torch.Generator(device="cpu").manual_seed(int(spec.seed))
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for path in paths:
            lin = self.modules[path]
            A = torch.empty(spec.rank, lin.in_features, dtype=self.param_dtype)  # (r, in)
            init_lora_a(A, gen)
            B = torch.zeros(lin.out_features, spec.rank, dtype=self.param_dtype)  # (out, r)
            weights[path] = (A, B)
        scale = spec.alpha / spec.rank
        return self.add(adapter_id, spec, weights, {p: scale for p in paths})

    def add(
        self,
        adapter_id: str,
        spec: LoraSpec,
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
        scales: dict[str, float],
        replace: bool = False,
    ) -> Adapter:
        """Register a live adapter from given A/B tensors (copied); used by loaders too."""
        for path in sorted(weights):
            A, B = weights[path]
            lin = self._linear(path)
            r = A.shape[0]
            if tuple(A.shape) != (r, lin.in_features) or tuple(B.shape) != (lin.out_features, r):
                raise InvalidRequestError(
                    f"lora weights of {path!r}: A has shape {tuple(A.shape)}, B "
                    f"{tuple(B.shape)}, expected ({r}, {lin.in_features}) and "
                    f"({lin.out_features}, {r})"
                )
        if replace and adapter_id in self.adapters:
            self.drop(adapter_id)
        self._check_free(adapter_id)
        device = self._device()
        layers: dict[str, LoraPair] = {}
        for path in sorted(weights):
            A, B = weights[path]
            A = nn.Parameter(A.detach().to(device, self.param_dtype).clone())  # (r, in)
            B = nn.Parameter(B.detach().to(device, self.param_dtype).clone())  # (out, r)
            layers[path] = LoraPair(A, B, float(scales[path]))
            self._hook(path)
        adapter = Adapter(adapter_id, spec, layers, trainable=True)
        self.adapters[adapter_id] = adapter
        return adapter

    def drop(self, adapter_id: str) -> None:
        """Free the adapter's tensors, gradients and whatever the trainer kept in .extra."""
        adapter = self.adapters.pop(adapter_id, None)
        if adapter is None:
            raise NotFoundError(f"adapter {adapter_id!r} does not exist")
        adapter.layers.clear()
        adapter.extra.clear()

    def snapshot(self, adapter_id: str, snapshot_id: str) -> Adapter:
        """Freeze a copy of the adapter's current weights (memory only, detached)."""
        src = self.live(adapter_id)
        self._check_free(snapshot_id)
        layers = {
            path: LoraPair(p.A.detach().clone(), p.B.detach().clone(), p.scale)
            for path, p in src.layers.items()
        }
        snap = Adapter(snapshot_id, src.spec, layers, trainable=False)
        self.snapshots[snapshot_id] = snap
        return snap

    def drop_snapshot(self, snapshot_id: str) -> None:
        if self.snapshots.pop(snapshot_id, None) is None:
            raise NotFoundError(f"snapshot {snapshot_id!r} does not exist")

    def live(self, adapter_id: str) -> Adapter:
        try:
            return self.adapters[adapter_id]
        except KeyError:
            raise NotFoundError(f"adapter {adapter_id!r} does not exist") from None

    def get(self, key: str) -> Adapter:
        """A live adapter or a snapshot by id."""
        found = self.adapters.get(key) or self.snapshots.get(key)
        if found is None:
            raise NotFoundError(f"no adapter or snapshot with id {key!r}")
        return found

    def __contains__(self, key: object) -> bool:
        return key in self.adapters or key in self.snapshots

    # ---- routing ----
    @contextmanager
    def rows(self, keys: list[str | None]) -> Iterator[None]:
        """Route row i of the next model calls to adapter keys[i] (None: the base model)."""
        route = self._plan(list(keys))
        previous, self._route = self._route, route
        try:
            yield
        finally:
            self._route = previous

    def _plan(self, keys: list[str | None]) -> _Route:
        adapters = {k: self.get(k) for k in dict.fromkeys(keys) if k is not None}
        if not adapters:
            return _Route(len(keys), None, [])
        if len(adapters) == 1 and None not in keys:
            return _Route(len(keys), next(iter(adapters.values())), [])
        order = list(dict.fromkeys(keys))  # distinct keys by first appearance
        runs = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
        segments = [(adapters.get(k) if k is not None else None, keys.count(k)) for k in order]
        device = self._device()
        slot = {k: i for i, k in enumerate(order)}
        slots = torch.tensor([slot[k] for k in keys], device=device)
        if len(runs) == len(order):  # each key's rows already contiguous
            return _Route(len(keys), None, segments, slots=slots)
        perm_list = sorted(range(len(keys)), key=lambda i: slot[keys[i]])  # stable
        perm = torch.tensor(perm_list, device=device)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(len(keys), device=device)
        return _Route(len(keys), None, segments, perm, inverse, slots)

    def _hook(self, path: str) -> None:
        if path in self._hooked:
            return
        module = self._linear(path)
        base_forward = type(module).forward  # nn.Linear's (or a subclass's), unbound

        def forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            route = self._route
            if route is None:
                return base_forward(module, x)
            if x.shape[0] != route.n_rows:
                raise RuntimeError(
                    f"{path}: input has {x.shape[0]} rows but rows() routed {route.n_rows}"
                )
            if route.whole is not None:
                pair = route.whole.layers.get(path)
                if pair is None:
                    return base_forward(module, x)
                if self._merges(module, pair, x):
                    return F.linear(x, _merged_weight(module, pair), module.bias)
                out = base_forward(module, x)  # (B, T, out)
                return (out + _delta(x, pair)).to(out.dtype)
            pairs = [a.layers.get(path) if a is not None else None for a, _ in route.segments]
            out = base_forward(module, x)  # (B, T, out)
            if all(p is None for p in pairs):
                return out
            if x.shape[1] <= CONCAT_MAX_TOKENS:
                return (out + _concat_delta(x, pairs, route)).to(out.dtype)
            return (out + _segmented_delta(x, pairs, route)).to(out.dtype)

        # An instance-level forward rather than a forward hook: a hook only runs after the base
        # matmul, which the merged path must skip. Installed once per layer and reading the
        # route on every call, it needs no swapping in rows() (nesting, exceptions); bound as
        # a method so a deep copy of the model calls its own weights; remove_hooks deletes it
        # and the class's forward shows through again.
        module.forward = types.MethodType(forward, module)
        self._hooked[path] = module

    def _merges(self, module: nn.Linear, pair: LoraPair, x: torch.Tensor) -> bool:
        if not self.merge_when_cheaper or x.shape[1] <= CONCAT_MAX_TOKENS:
            return False
        if not module.weight.is_floating_point():  # a quantized base cannot be merged into
            return False
        grad = torch.is_grad_enabled()
        return merge_is_cheaper(
            x.shape[:-1].numel(),
            module.in_features,
            module.out_features,
            pair.A.shape[0],
            grad_weights=grad and (pair.A.requires_grad or pair.B.requires_grad),
            grad_input=grad and x.requires_grad,
        )

    def remove_hooks(self) -> None:
        """Detach the bank from the model (the base then runs as plain transformers)."""
        for module in self._hooked.values():
            del module.forward
        self._hooked.clear()

    # ---- helpers ----
    def _linear(self, path: str) -> nn.Linear:
        lin = self.modules.get(path)
        if not isinstance(lin, nn.Linear):
            raise InvalidRequestError(
                f"lora target {path!r} is not a linear layer of this model; expected one of "
                f"{list(self.targets)[:4]}..."
            )
        return lin

    def _check_free(self, key: str) -> None:
        if key in self:
            raise ConflictError(f"id {key!r} is already used by an adapter or snapshot")

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device


def _segmented_delta(x: torch.Tensor, pairs: list, route: _Route) -> torch.Tensor:
    """Split the rows by adapter, one matmul pair per adapter, concatenate: (B, T, out)."""
    xs = x if route.perm is None else x.index_select(0, route.perm)  # (B, T, in)
    pieces = xs.split([n for _, n in route.segments])
    deltas = [
        None if pair is None else _delta(piece, pair)  # (n, T, out)
        for pair, piece in zip(pairs, pieces, strict=True)
    ]
    real = next(d for d in deltas if d is not None)
    # rows without a LoRA here add an exact zero: the arithmetic of the one-adapter path
    delta = torch.cat(
        [
            d if d is not None else real.new_zeros((p.shape[0], *real.shape[1:]))
            for d, p in zip(deltas, pieces, strict=True)
        ]
    )  # (B, T, out)
    return delta if route.inverse is None else delta.index_select(0, route.inverse)


def _concat_delta(x: torch.Tensor, pairs: list, route: _Route) -> torch.Tensor:
    """All adapters at once: x @ [A_1; ...; A_S]^T, keep each row's own rank slice (times
    its scale), then @ [B_1 ... B_S]^T. Two matmuls that read every adapter's weights once:
    the cheapest shape for decoding, where a few tokens meet many adapters. (B, T, out)
    """
    present = [p for p in pairs if p is not None]
    key = tuple(id(p) for p in pairs)
    cached = route.cache.get(key) if not torch.is_grad_enabled() else None
    if cached is None:
        a_cat = torch.cat([p.A for p in present])  # (R, in)
        b_cat = torch.cat([p.B for p in present], dim=1)  # (out, R)
        cached = (a_cat, b_cat)
        if not torch.is_grad_enabled():  # weights cannot change inside one sampling call
            route.cache[key] = cached
    a_cat, b_cat = cached
    sig = tuple((p.A.shape[0], p.scale) if p is not None else None for p in pairs)
    mask = route.cache.get(sig)
    if mask is None:
        columns = []  # per segment: its scale on its own rank slice, zero elsewhere
        for p in pairs:
            row = []
            for q in present:
                value = p.scale if q is p else 0.0
                row += [value] * q.A.shape[0]
            columns.append(row)
        per_slot = torch.tensor(columns, dtype=a_cat.dtype, device=a_cat.device)  # (S, R)
        mask = route.cache[sig] = per_slot[route.slots][:, None, :]  # (B, 1, R)
    h = F.linear(x.to(a_cat.dtype), a_cat) * mask  # (B, T, R)
    return F.linear(h, b_cat)  # (B, T, out)


def _merged_weight(module: nn.Linear, pair: LoraPair) -> torch.Tensor:
    """W + scale * B @ A as a new tensor (W may be a tied embedding: never written), summed in
    the adapter's dtype, then in the base's dtype for the one matmul. (out, in)

    Not cached under no_grad like the stacked weights: the sampler opens one rows() context
    per prefill, and decode steps never merge, so a cache would only hold a copy of every
    targeted weight until the context ends.
    """
    W = module.weight  # (out, in)
    return torch.addmm(W.to(pair.A.dtype), pair.B, pair.A, alpha=pair.scale).to(W.dtype)


def _delta(x: torch.Tensor, pair: LoraPair) -> torch.Tensor:
    """scale * B(A x) in the adapter's dtype (PEFT casts the input the same way)."""
    x = x.to(pair.A.dtype)
    return F.linear(F.linear(x, pair.A), pair.B) * pair.scale  # (..., out)


def _check_spec(spec: LoraSpec) -> None:
    if not isinstance(spec.rank, int) or spec.rank < 1:
        raise InvalidRequestError(f"lora rank must be an integer >= 1, got {spec.rank!r}")
    if not math.isfinite(spec.alpha) or spec.alpha <= 0:
        raise InvalidRequestError(f"lora alpha must be a finite number > 0, got {spec.alpha!r}")
