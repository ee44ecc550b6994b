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
- several tokens per row (prefill), or any call with gradients (training): the input is split
  into the contiguous rows of each adapter (permuted first when an adapter's rows are
  scattered), one matmul pair per adapter, the updates concatenated: linear in the batch;
- one token per row without gradients (a decode step): the rows are put in groups of one
  adapter each, every group gets its own adapter's A and B (zero-padded to the largest rank,
  built once per rows() context), and two batched matmuls serve all groups at once (the
  BGMV / SGMV shape of Punica and S-LoRA): a step then costs reading each adapter once.
Isolation: a row's numbers depend only on its own adapter and the base, whatever shares its
batch. No path multiplies a row by another adapter's weights, not even by a zero mask (a
NaN adapter would otherwise poison its neighbours: NaN * 0 is NaN). Rows without a LoRA on a
layer (base rows) add an exact zero that no arithmetic produced, so they get the base's
output; a fresh adapter (B = 0) is the base. Inside one rows() context under no_grad each
layer's grouped weights are built once and reused across calls: do not change adapter
weights in place inside such a context.
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
    Decode steps take the grouped path instead (_grouped), which reads `slots`.
    """

    n_rows: int
    whole: Adapter | None  # set when every row uses this one adapter (no indexing)
    segments: list[tuple[Adapter | None, int]]  # (adapter or None for base, rows), in order
    perm: torch.Tensor | None = None  # (B,) row order that makes segments contiguous
    inverse: torch.Tensor | None = None  # (B,) undoes perm
    slots: list[int] = field(default_factory=list)  # segment index of each row
    cache: dict = field(default_factory=dict)  # per-route layouts and weights of _grouped


# Rows this short are decoding: a single adapter keeps the low-rank product (merging would
# rebuild W + s B A on every step for a token or two, see merge_is_cheaper).
DECODE_MAX_TOKENS = 8


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

    def max_rank(self, spec: LoraSpec) -> int:
        """The largest rank create() accepts for the layers spec targets (0: it targets none).

        That is the largest min(in_features, out_features) among those layers, the model's
        width for the usual architectures: a higher rank is already full rank on every
        targeted layer, so it would only cost memory (rank 2**31 would ask for terabytes).
        """
        return self._full_rank(self.target_paths(spec))

    def create(self, adapter_id: str, spec: LoraSpec) -> Adapter:
        """A fresh adapter: A kaiming-uniform from spec.seed, B zero, so it equals the base.

        The rank is checked against max_rank(spec) before anything is allocated.
        """
        _check_spec(spec)
        paths = self.target_paths(spec)
        if not paths:
            raise InvalidRequestError(
                "lora spec trains nothing: set at least one of train_attn, train_mlp, "
                f"train_unembed to true (got {spec.train_attn}, {spec.train_mlp}, "
                f"{spec.train_unembed}), or this model has no such layers"
            )
        bound = self.max_rank(spec)
        if spec.rank > bound:
            raise InvalidRequestError(
                f"lora rank must be <= {bound} for this model's targeted layers (the largest "
                f"min(in_features, out_features) among them: a higher rank adds nothing), "
                f"got {spec.rank}"
            )
        self._check_free(adapter_id)
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
        """Register a live adapter from given A/B tensors (copied); used by loaders too.

        Refused with InvalidRequestError, before it can join a batch: shapes that do not fit
        the layer, a rank outside [1, max_rank] of its layers, and weights or updates that
        are not finite (unsafe_layer), whose NaN would at least ruin the adapter's own rows.
        """
        bound = self._full_rank(list(weights))
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
            if not 1 <= r <= bound:
                raise InvalidRequestError(
                    f"lora weights of {path!r}: rank must be in [1, {bound}] for these "
                    f"layers (the largest min(in_features, out_features) among them), got {r}"
                )
        if not (replace and adapter_id in self.adapters):
            self._check_free(adapter_id)
        device = self._device()
        layers: dict[str, LoraPair] = {}
        for path in sorted(weights):
            A, B = weights[path]
            A = nn.Parameter(A.detach().to(device, self.param_dtype).clone())  # (r, in)
            B = nn.Parameter(B.detach().to(device, self.param_dtype).clone())  # (out, r)
            layers[path] = LoraPair(A, B, float(scales[path]))
        unsafe = unsafe_layer(layers)
        if unsafe is not None:
            raise InvalidRequestError(
                f"lora weights of adapter {adapter_id!r} are not finite, or their update "
                f"scale * B A would overflow ({unsafe}); refused"
            )
        if replace and adapter_id in self.adapters:
            self.drop(adapter_id)
        self._check_free(adapter_id)
        for path in layers:
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
        slots = [slot[k] for k in keys]
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
        plain = type(module) is nn.Linear  # its single-adapter calls may take _LoraLinear

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
                fusable = (
                    plain
                    and not module.weight.requires_grad  # a frozen base, as always here
                    and x.dtype == module.weight.dtype == pair.A.dtype
                )
                if self._merges(module, pair, x):
                    return F.linear(x, _merged_weight(module, pair), module.bias)
                if fusable:
                    return _LoraLinear.apply(
                        x, module.weight, module.bias, pair.A, pair.B, pair.scale
                    )
                out = base_forward(module, x)  # (B, T, out)
                return (out + _delta(x, pair)).to(out.dtype)
            out = base_forward(module, x)  # (B, T, out)
            # one token per row without gradients: a decode step, one of many in the same
            # rows() context, which pays for building the grouped weights once
            if x.dim() == 3 and x.shape[1] == 1 and not torch.is_grad_enabled():
                return _grouped(x, out, route, path)
            delta = _segmented_delta(x, route, path)
            return out if delta is None else (out + delta).to(out.dtype)

        # An instance-level forward rather than a forward hook: a hook only runs after the base
        # matmul, which the merged path must skip. Installed once per layer and reading the
        # route on every call, it needs no swapping in rows() (nesting, exceptions); bound as
        # a method so a deep copy of the model calls its own weights; remove_hooks deletes it
        # and the class's forward shows through again.
        module.forward = types.MethodType(forward, module)
        self._hooked[path] = module

    def _merges(self, module: nn.Linear, pair: LoraPair, x: torch.Tensor) -> bool:
        if not self.merge_when_cheaper or x.shape[1] <= DECODE_MAX_TOKENS:
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

    def _full_rank(self, paths: list[str]) -> int:
        """The largest min(in_features, out_features) among these layers (0: none)."""
        ranks = [min(self._linear(p).in_features, self._linear(p).out_features) for p in paths]
        return max(ranks, default=0)

    def _check_free(self, key: str) -> None:
        if key in self:
            raise ConflictError(f"id {key!r} is already used by an adapter or snapshot")

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device


def _segmented_delta(x: torch.Tensor, route: _Route, path: str) -> torch.Tensor | None:
    """Split the rows by adapter, one matmul pair per adapter, concatenate: (B, T, out).

    None when no row has a LoRA on this layer.
    """
    pairs = [a.layers.get(path) if a is not None else None for a, _ in route.segments]
    if all(p is None for p in pairs):
        return None
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


@dataclass
class _Groups:
    """The rows of one layer call that have a LoRA there, as G groups of `size` rows, every
    group of one adapter (segment). Groups shorter than `size` repeat their own first row,
    whose extra result is dropped: padding never borrows another adapter's row."""

    segments: list[int]  # (G,) the segment of each group
    size: int
    src: torch.Tensor | None  # (G*size,) batch row read into each group slot; None: identity
    # (B,) the group slot of each batch row, G*size (an appended zero row) for rows with no
    # LoRA on this layer; None: identity
    dst: torch.Tensor | None


def _group_rows(slots: list[int], present: tuple[bool, ...], device: torch.device) -> _Groups:
    """Groups of at most ceil(rows / adapters) rows: an adapter with many rows gets several
    groups, so padding costs at most about as many rows as the batch has."""
    rows_of: dict[int, list[int]] = {}
    for i, s in enumerate(slots):
        if present[s]:
            rows_of.setdefault(s, []).append(i)
    size = -(-sum(len(r) for r in rows_of.values()) // len(rows_of))
    segments: list[int] = []
    src: list[int] = []
    for s, rows in sorted(rows_of.items()):
        for k in range(0, len(rows), size):
            chunk = rows[k : k + size]
            segments.append(s)
            src += chunk + [chunk[0]] * (size - len(chunk))
    if src == list(range(len(slots))):
        return _Groups(segments, size, None, None)
    dst = [len(src)] * len(slots)
    for pos in reversed(range(len(src))):  # the first slot of a row, not its padding copies
        dst[src[pos]] = pos
    as_tensor = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return _Groups(segments, size, as_tensor(src), as_tensor(dst))


def _group_weights(pairs: list, groups: _Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's own A^T and scale * B, zero-padded to the largest rank among them:
    (G, in, r), and (G, out, r) for groups of one row else (G, r, out), the layouts that
    _grouped reads fastest. Built under no_grad, into fresh tensors."""
    ranks = {s: pairs[s].A.shape[0] for s in groups.segments}
    r, first = max(ranks.values()), pairs[groups.segments[0]]
    n_in, n_out, G = first.A.shape[1], first.B.shape[0], len(groups.segments)
    new = first.A.new_zeros if min(ranks.values()) < r else first.A.new_empty
    a_g = new((G, n_in, r))
    b_g = new((G, n_out, r) if groups.size == 1 else (G, r, n_out))
    for g, s in enumerate(groups.segments):
        pair, k = pairs[s], ranks[s]
        a_g[g, :, :k] = pair.A.t()
        if groups.size == 1:
            torch.mul(pair.B, pair.scale, out=b_g[g, :, :k])
        else:
            torch.mul(pair.B.t(), pair.scale, out=b_g[g, :k, :])
    return a_g, b_g


def _grouped(x: torch.Tensor, out: torch.Tensor, route: _Route, path: str) -> torch.Tensor:
    """out + scale * B(A x) of every row with its own adapter, for one token per row: the
    rows are gathered into groups of one adapter each, then x_g @ A_g^T and (s B_g) @ h run
    as two batched matmuls over the groups. Each row only ever meets its own adapter's
    weights; rows without a LoRA on this layer return `out` as it is. No-grad calls only:
    the layout and the weights are built once per route and layer, then reused.
    """
    entry = route.cache.get(path)
    if entry is None:
        pairs = [a.layers.get(path) if a is not None else None for a, _ in route.segments]
        present = tuple(p is not None for p in pairs)
        entry = (None, None, None)
        if any(present):
            groups = route.cache.get(present)
            if groups is None:  # the same for every layer that the same adapters target
                groups = route.cache[present] = _group_rows(route.slots, present, x.device)
            entry = (groups, *_group_weights(pairs, groups))
        route.cache[path] = entry
    groups, a_g, b_g = entry
    if groups is None:
        return out
    B, G, size = x.shape[0], a_g.shape[0], groups.size
    n_in, n_out = a_g.shape[1], out.shape[-1]
    if groups.src is None and size == 1 and out.dtype == x.dtype == a_g.dtype:
        # the common decode step, each row its own group: (G, out, r) @ (G, r, 1) reads B
        # fastest here, into the (G, out, 1) view of out: the add fuses into the matmul
        h = torch.bmm(x, a_g)  # (B, 1, r)
        return torch.baddbmm(out.transpose(1, 2), b_g, h.transpose(1, 2)).transpose(1, 2)
    xs = x.to(a_g.dtype).reshape(B, n_in)  # (B, in)
    if groups.src is not None:
        xs = xs.index_select(0, groups.src)  # (G*size, in)
    h = torch.bmm(xs.reshape(G, size, n_in), a_g)  # (G, size, r)
    if size == 1:  # b_g (G, out, r); a (G, out, 1) result is the memory of (G, 1, out)
        delta = torch.bmm(b_g, h.transpose(1, 2))  # (G, out, 1)
    elif groups.dst is None and out.dtype == b_g.dtype:  # the add fuses into the matmul
        return torch.baddbmm(out.reshape(G, size, n_out), h, b_g).reshape(out.shape)
    else:
        delta = torch.bmm(h, b_g)  # (G, size, out)
    delta = delta.reshape(G * size, n_out)
    if groups.dst is not None:
        zero = delta.new_zeros((1, n_out))  # the exact zero of the rows without LoRA here
        delta = torch.cat([delta, zero]).index_select(0, groups.dst)  # (B, out)
    return (out + delta.reshape(out.shape)).to(out.dtype)


def _merged_weight(module: nn.Linear, pair: LoraPair) -> torch.Tensor:
    """W + scale * B @ A as a new tensor (W may be a tied embedding: never written), summed in
    the adapter's dtype, then in the base's dtype for the one matmul. (out, in)

    Not cached under no_grad like the stacked weights: the sampler opens one rows() context
    per prefill, and decode steps never merge, so a cache would only hold a copy of every
    targeted weight until the context ends.
    """
    W = module.weight  # (out, in)
    return torch.addmm(W.to(pair.A.dtype), pair.B, pair.A, alpha=pair.scale).to(W.dtype)


class _LoraLinear(torch.autograd.Function):
    """x W^T + b + scale * (x A^T) B^T for one adapter on a frozen nn.Linear, all of one
    dtype: the base call plus _delta's numbers, in fewer passes over the output.

    The (N, r) product is scaled, not the (N, out) update, and the update is accumulated
    into the base matmul's result by addmm (no separate add). Backward as _LoraDelta's.
    """

    @staticmethod
    def forward(ctx, x, W, b, A, B, scale):
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        hs = (x2 @ A.t()).mul_(scale)  # (N, r)
        y = x2 @ W.t() if b is None else torch.addmm(b, x2, W.t())  # (N, out)
        y.addmm_(hs, B.t())
        ctx.save_for_backward(x2, W, A, B, hs)
        ctx.scale, ctx.in_shape = scale, x.shape
        return y.view(*x.shape[:-1], W.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2, W, A, B, hs = ctx.saved_tensors
        need_x, _, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
        dx, dA, dB = _lora_grads(dy2, x2, A, B, hs, ctx.scale, need_x, need_a, need_b)
        if need_x:  # summed as autograd sums the base's and _LoraDelta's: the same numbers
            dx = (dy2 @ W).add_(dx).view(ctx.in_shape)  # (..., in)
        db = dy2.sum(0) if need_bias else None
        return dx, None, db, dA, dB, None


class _LoraDelta(torch.autograd.Function):
    """scale * (x A^T) B^T, the (N, r) product scaled, with a backward whose skinny matmuls
    run with their long dimension inner (r x N @ N x out, then transposed): BLAS runs those
    several times faster than the (out x N) @ (N x r) layout autograd picks, which on a
    large unembedding cost more than the rest of the LoRA."""

    @staticmethod
    def forward(ctx, x, A, B, scale):
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        hs = (x2 @ A.t()).mul_(scale)  # (N, r)
        ctx.save_for_backward(x2, A, B, hs)
        ctx.scale, ctx.in_shape = scale, x.shape
        return (hs @ B.t()).view(*x.shape[:-1], B.shape[0])  # (..., out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2, A, B, hs = ctx.saved_tensors
        need_x, need_a, need_b, _ = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
        dx, dA, dB = _lora_grads(dy2, x2, A, B, hs, ctx.scale, need_x, need_a, need_b)
        return None if dx is None else dx.view(ctx.in_shape), dA, dB, None


def _lora_grads(dy2, x2, A, B, hs, scale, need_x, need_a, need_b):
    """(dX from the update only, dA, dB) of scale * (x A^T) B^T, each None when not needed."""
    dx = dA = dB = None
    if need_b:
        dB = (hs.t() @ dy2).t().contiguous()  # (out, r)
    if need_a or need_x:
        dh = (B.t() @ dy2.t()).t().mul(scale)  # (N, r)
        if need_a:
            dA = dh.t() @ x2  # (r, in)
        if need_x:
            dx = dh @ A  # (N, in)
    return dx, dA, dB


def _delta(x: torch.Tensor, pair: LoraPair) -> torch.Tensor:
    """scale * B(A x) in the adapter's dtype (PEFT casts the input the same way). The scale
    multiplies the rank-r product, as _LoraLinear does: rows of one adapter get the same
    numbers whether their call takes this path or that one."""
    return _LoraDelta.apply(x.to(pair.A.dtype), pair.A, pair.B, pair.scale)  # (..., out)


def tensor_peaks(tensors: list[torch.Tensor]) -> list[float]:
    """max |x| of each tensor, nan or inf where it is not finite: one host sync for all."""
    if not tensors:
        return []
    # abs().amax() propagates NaN and is several times faster here than an inf-norm or isfinite
    return torch.stack([t.detach().abs().amax().float() for t in tensors]).tolist()


def unsafe_layer(layers: dict[str, LoraPair]) -> str | None:
    """The first layer whose A, B or update scale * B A may not be finite (None: all safe).

    Every entry of the update is at most |scale| * rank * max|A| * max|B|; keeping that under
    the adapter dtype's largest value keeps the update and the merged weight W + s B A of
    the single-adapter path finite, not just A and B (after learning_rate 1e30 both are
    still finite, around 1e30, while B A overflows).
    """
    pairs = list(layers.items())
    peaks = tensor_peaks([t for _, pair in pairs for t in (pair.A, pair.B)])
    for i, (path, pair) in enumerate(pairs):
        a, b = peaks[2 * i], peaks[2 * i + 1]
        bound = abs(pair.scale) * pair.A.shape[0] * a * b
        if not (math.isfinite(bound) and bound <= torch.finfo(pair.A.dtype).max):
            return f"{path}: max |A| {a:.3g}, max |B| {b:.3g}, scale {pair.scale:.3g}"
    return None


def _check_spec(spec: LoraSpec) -> None:
    if not isinstance(spec.rank, int) or spec.rank < 1:
        raise InvalidRequestError(f"lora rank must be an integer >= 1, got {spec.rank!r}")
    if not math.isfinite(spec.alpha) or spec.alpha <= 0:
        raise InvalidRequestError(f"lora alpha must be a finite number > 0, got {spec.alpha!r}")
