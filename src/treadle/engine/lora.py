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
- any call with gradients (training): the rows are put in contiguous runs of one adapter
  each (permuted first when an adapter's rows are scattered), the base matmul runs once and
  each run's low-rank update is accumulated into its own rows (_SegmentedLoraLinear, one
  matmul pair per adapter, no (B, T, out) update built); linear in the batch;
- without gradients (a prefill, a decode step, a logprob pass): the rows are put in groups
  of one adapter each, every group gets its own adapter's A and B (zero-padded to the
  largest rank, kept across calls by WeightStacks), and two batched matmuls serve all
  groups at once (the BGMV / SGMV shape of Punica and S-LoRA): a decode step then costs
  reading each adapter once.
Isolation: a row's numbers depend only on its own adapter and the base, whatever shares its
batch. No path multiplies a row by another adapter's weights, not even by a zero mask (a
NaN adapter would otherwise poison its neighbours: NaN * 0 is NaN). Rows without a LoRA on a
layer (base rows) add an exact zero that no arithmetic produced, so they get the base's
output; a fresh adapter (B = 0) is the base. Inside one rows() context under no_grad each
layer's grouped weights are built once and reused across calls: do not change adapter
weights in place inside such a context.

A mixture-of-experts model's fused expert weights (3-D `gate_up_proj` / `down_proj`) are
targets too, one low-rank update per expert, routed per row the same way through the experts
module's forward (lora_experts).

This module holds the bank (adapters, snapshots, the routing and the layer forward it
installs); the pieces it uses live beside it, and their public names are importable from
here too: lora_adapters (Adapter, LoraPair, the target classes and the finiteness checks),
lora_kernels (the single-adapter path: fused autograd functions, the merge rule),
lora_routing (the multi-adapter paths: segmented and grouped), lora_experts (MoE experts).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from treadle.engine.lora_adapters import (
    ATTN,
    MLP,
    UNEMBED,
    Adapter,
    LoraPair,
    _check_spec,
    classify_linear_modules,
    init_lora_a,
    unsafe_layer,
)
from treadle.engine.lora_adapters import tensor_peaks as tensor_peaks  # re-exported
from treadle.engine.lora_experts import find_expert_params, install_routed_experts
from treadle.engine.lora_kernels import (
    DECODE_MAX_TOKENS,
    _delta,
    _LoraLinear,
    _merged_weight,
    merge_is_cheaper,
)
from treadle.engine.lora_kernels import _LoraDelta as _LoraDelta  # re-exported
from treadle.engine.lora_routing import (
    WeightStacks,
    _grouped,
    _Route,
    _segmented_delta,
    _segmented_linear,
)
from treadle.engine.types import LoraSpec
from treadle.errors import ConflictError, InvalidRequestError, NotFoundError


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
        # fused 3-D expert weights of MoE models (lora_experts): MLP targets, one update each
        self.experts = find_expert_params(model)
        linear = classify_linear_modules(model)
        self.targets = dict(sorted((linear | dict.fromkeys(self.experts, MLP)).items()))
        self.adapters: dict[str, Adapter] = {}
        self.snapshots: dict[str, Adapter] = {}
        self._hooked: dict[str, nn.Module] = {}  # paths whose forward is ours
        self._route: _Route | None = None
        self.stacks = WeightStacks()  # _grouped's stacked adapter weights, across routes

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
            E, n_in, n_out = self._dims(path)
            lead = () if E is None else (E,)  # an expert weight: one pair per expert
            A = torch.empty(*lead, spec.rank, n_in, dtype=self.param_dtype)  # ([E,] r, in)
            init_lora_a(A.view(-1, n_in), gen)  # fan-in `in`, as peft's (r*E, in) lora_A
            B = torch.zeros(*lead, n_out, spec.rank, dtype=self.param_dtype)  # ([E,] out, r)
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
            E, n_in, n_out = self._dims(path)
            lead = () if E is None else (E,)
            r = A.shape[-2] if A.ndim >= 2 else 0
            if tuple(A.shape) != (*lead, r, n_in) or tuple(B.shape) != (*lead, n_out, r):
                raise InvalidRequestError(
                    f"lora weights of {path!r}: A has shape {tuple(A.shape)}, B "
                    f"{tuple(B.shape)}, expected {(*lead, r, n_in)} and {(*lead, n_out, r)}"
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
        self.stacks.clear()  # they may hold copies of its weights: free those too

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
        self.stacks.clear()

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
            return _Route(len(keys), None, segments, slots=slots, stacks=self.stacks)
        perm_list = sorted(range(len(keys)), key=lambda i: slot[keys[i]])  # stable
        perm = torch.tensor(perm_list, device=device)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(len(keys), device=device)
        return _Route(len(keys), None, segments, perm, inverse, slots, stacks=self.stacks)

    def _hook(self, path: str) -> None:
        if path in self.experts:
            return self._hook_experts(self.experts[path].module)
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
            # without gradients (a prefill and its decode steps, a logprob pass): batched
            # matmuls over groups of one adapter, on weights stacked once (WeightStacks)
            if x.dim() == 3 and not torch.is_grad_enabled():
                return _grouped(x, base_forward(module, x), route, path)
            if plain and not module.weight.requires_grad:  # each segment fused, as above
                fused = _segmented_linear(x, module, route, path)
                if fused is not None:
                    return fused
            out = base_forward(module, x)  # (B, T, out)
            delta = _segmented_delta(x, route, path)
            return out if delta is None else (out + delta).to(out.dtype)

        # An instance-level forward rather than a forward hook: a hook only runs after the base
        # matmul, which the merged path must skip. Installed once per layer and reading the
        # route on every call, it needs no swapping in rows() (nesting, exceptions); bound as
        # a method so a deep copy of the model calls its own weights; remove_hooks deletes it
        # and the class's forward shows through again.
        module.forward = types.MethodType(forward, module)
        self._hooked[path] = module

    def _hook_experts(self, path: str) -> None:
        if path not in self._hooked:
            self._hooked[path] = install_routed_experts(
                self.modules[path], path, lambda: self._route
            )

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

    def _dims(self, path: str) -> tuple[int | None, int, int]:
        """(experts or None for an nn.Linear, in_features, out_features) of a target."""
        if path in self.experts:
            p = self.experts[path]
            return p.num_experts, p.in_features, p.out_features
        lin = self._linear(path)
        return None, lin.in_features, lin.out_features

    def _full_rank(self, paths: list[str]) -> int:
        """The largest min(in_features, out_features) among these layers (0: none)."""
        return max((min(self._dims(p)[1:]) for p in paths), default=0)

    def _check_free(self, key: str) -> None:
        if key in self:
            raise ConflictError(f"id {key!r} is already used by an adapter or snapshot")

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device
