"""The multi-adapter paths of a LoRA layer: a call whose rows use several adapters.

_Route is what AdapterBank.rows() plans (treadle.engine.lora); each LoRA layer then reads
it: calls with gradients run the base matmul once and add each adapter's update to its own
rows (_segmented_linear, one matmul pair per adapter; where it does not apply, the base
call plus _segmented_delta); calls without (decode steps, prefills, logprob passes) gather
the rows into groups of one adapter and run two batched matmuls for all groups (_grouped,
the BGMV / SGMV shape) on stacked weights that WeightStacks keeps from one call to the
next. No path multiplies a row by another adapter's weights.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from treadle.engine.lora_adapters import Adapter, LoraPair
from treadle.engine.lora_kernels import _delta, _SegmentedLoraLinear


class _Stack(NamedTuple):
    """One layer's stacked weights, and the tensors (at their versions) they were made of."""

    a_g: torch.Tensor
    b_g: torch.Tensor
    sources: list[tuple[torch.Tensor, torch.Tensor]]  # each group's (A, B)
    versions: list[tuple[int, int]]

    @property
    def nbytes(self) -> int:
        return self.a_g.nbytes + self.b_g.nbytes

    def still_of(self, members: list) -> bool:
        """Made of these very tensors, none changed since."""
        return all(
            a is p.A and b is p.B and v == (p.A._version, p.B._version)
            for (a, b), v, p in zip(self.sources, self.versions, members, strict=True)
        )


class WeightStacks:
    """The stacked weights of _grouped, kept from one rows() context to the next.

    A sampler's prefill and its decode steps are separate contexts, and so is every round of
    the continuous decode batch: without this each would copy every adapter of the batch
    into fresh stacks (8 rank-32 adapters of the small tiny model: 51 MB, twice per call).
    An entry holds its source tensors, so their ids cannot be reused while it lives, and is
    valid while each is at the version it was stacked from: every in-place update (an
    optimizer step, a restore's copy_) bumps a tensor's version. The last `max_sets` sets
    of adapters are kept, in at most `max_bytes` of copies: a set larger than that (64
    adapters of a large model) is stacked for each route instead, as if nothing were kept.
    """

    def __init__(self, max_sets: int = 2, max_bytes: int = 1 << 30):
        self.max_sets = max_sets
        self.max_bytes = max_bytes
        self._sets: OrderedDict[tuple, dict[str, _Stack]] = OrderedDict()
        self._bytes: dict[tuple, int] = {}

    def get(
        self, route: _Route, pairs: list, groups: _Groups, path: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (A_g, B_g) for these groups: kept, or stacked now."""
        key = (groups.size == 1, *(id(route.segments[s][0]) for s in groups.segments))
        members = [pairs[s] for s in groups.segments]
        layers = self._sets.setdefault(key, {})
        self._sets.move_to_end(key)
        stack = layers.get(path)
        if stack is None or not stack.still_of(members):
            old = 0 if stack is None else stack.nbytes
            sources = [(p.A, p.B) for p in members]
            versions = [(p.A._version, p.B._version) for p in members]
            stack = layers[path] = _Stack(*_group_weights(pairs, groups), sources, versions)
            self._bytes[key] = self._bytes.get(key, 0) - old + stack.nbytes
            self._evict(keep=key)
        return stack.a_g, stack.b_g

    def _evict(self, keep: tuple) -> None:
        """The oldest sets out until the rest fit; `keep` too if it alone does not."""
        while len(self._sets) > 1 and (
            len(self._sets) > self.max_sets or self.nbytes > self.max_bytes
        ):
            oldest = next(iter(self._sets))
            self._sets.pop(oldest)
            self._bytes.pop(oldest, None)
        if self._bytes.get(keep, 0) > self.max_bytes:
            self._sets.pop(keep, None)
            self._bytes.pop(keep, None)

    def clear(self) -> None:
        self._sets.clear()
        self._bytes.clear()

    def __len__(self) -> int:
        """Sets of adapters kept."""
        return len(self._sets)

    @property
    def nbytes(self) -> int:
        """Bytes of stacked copies kept."""
        return sum(self._bytes.values())


@dataclass
class _Route:
    """How the rows of the next model calls map to adapters.

    Rows are cut into contiguous segments of one key each (after a permutation when a key's
    rows are scattered), so each LoRA layer splits its input once, runs one small matmul pair
    per segment and concatenates: forward and backward stay linear in the batch size.
    Calls without gradients take the grouped path instead (_grouped), which reads `slots`.
    """

    n_rows: int
    whole: Adapter | None  # set when every row uses this one adapter (no indexing)
    segments: list[tuple[Adapter | None, int]]  # (adapter or None for base, rows), in order
    perm: torch.Tensor | None = None  # (B,) row order that makes segments contiguous
    inverse: torch.Tensor | None = None  # (B,) undoes perm
    slots: list[int] = field(default_factory=list)  # segment index of each row
    cache: dict = field(default_factory=dict)  # per-route layouts and weights of _grouped
    # where _grouped keeps its stacked weights: the bank's, shared by its routes
    stacks: WeightStacks = field(default_factory=WeightStacks)


def _pairs(route: _Route, path: str) -> list[LoraPair | None]:
    """Each segment's LoraPair on this layer (None: base rows, or an adapter without one)."""
    return [a.layers.get(path) if a is not None else None for a, _ in route.segments]


def _segmented_delta(x: torch.Tensor, route: _Route, path: str) -> torch.Tensor | None:
    """Split the rows by adapter, one matmul pair per adapter, concatenate: (B, T, out).

    None when no row has a LoRA on this layer.
    """
    pairs = _pairs(route, path)
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


def _segmented_linear(
    x: torch.Tensor, module: torch.nn.Linear, route: _Route, path: str
) -> torch.Tensor | None:
    """The base call and every row's own update in one pass (_SegmentedLoraLinear): (B, T,
    out). None where that pass does not apply (no row has a LoRA here, an input not of the
    base's dtype, adapters of several dtypes): then the base call plus _segmented_delta."""
    pairs = _pairs(route, path)
    dtypes = {p.A.dtype for p in pairs if p is not None}
    if x.dim() != 3 or x.dtype != module.weight.dtype or len(dtypes) != 1:
        return None
    xs = x if route.perm is None else x.index_select(0, route.perm)  # (B, T, in)
    sizes = tuple(n for _, n in route.segments)
    scales = tuple(None if p is None else p.scale for p in pairs)
    tensors = [t for p in pairs if p is not None for t in (p.A, p.B)]
    y = _SegmentedLoraLinear.apply(xs, module.weight, module.bias, sizes, scales, *tensors)
    return y if route.inverse is None else y.index_select(0, route.inverse)


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
    """out + scale * B(A x) of every row with its own adapter, for a call without gradients
    (a decode step, a prefill, a logprob pass): the rows are gathered into groups of one
    adapter each, then x_g @ A_g^T and (s B_g) @ h run as two batched matmuls over the
    groups, whatever the number of tokens per row. Each row only ever meets its own
    adapter's weights; rows without a LoRA on this layer return `out` as it is. The layout
    is planned once per route, the stacked weights are kept by WeightStacks.
    """
    entry = route.cache.get(path)
    if entry is None:
        pairs = _pairs(route, path)
        present = tuple(p is not None for p in pairs)
        entry = (None, None, None)
        if any(present):
            groups = route.cache.get(present)
            if groups is None:  # the same for every layer that the same adapters target
                groups = route.cache[present] = _group_rows(route.slots, present, x.device)
            entry = (groups, *route.stacks.get(route, pairs, groups, path))
        route.cache[path] = entry
    groups, a_g, b_g = entry
    if groups is None:
        return out
    T, G, size = x.shape[1], a_g.shape[0], groups.size
    n_in, n_out = a_g.shape[1], out.shape[-1]
    if groups.src is None and size == 1 and T == 1 and out.dtype == x.dtype == a_g.dtype:
        # the common decode step, each row its own group: (G, out, r) @ (G, r, 1) reads B
        # fastest here, into the (G, out, 1) view of out: the add fuses into the matmul
        h = torch.bmm(x, a_g)  # (B, 1, r)
        return torch.baddbmm(out.transpose(1, 2), b_g, h.transpose(1, 2)).transpose(1, 2)
    xs = x.to(a_g.dtype)  # (B, T, in)
    if groups.src is not None:
        xs = xs.index_select(0, groups.src)  # (G*size, T, in)
    h = torch.bmm(xs.reshape(G, size * T, n_in), a_g)  # (G, size*T, r)
    b_rt = b_g.transpose(1, 2) if size == 1 else b_g  # (G, r, out), a view of (G, out, r)
    if groups.dst is None and out.dtype == b_g.dtype:  # the add fuses into the matmul
        return torch.baddbmm(out.reshape(G, size * T, n_out), h, b_rt).reshape(out.shape)
    delta = torch.bmm(h, b_rt)  # (G, size*T, out)
    delta = delta.reshape(G * size, T, n_out)
    if groups.dst is not None:
        zero = delta.new_zeros((1, T, n_out))  # the exact zero of the rows without LoRA here
        delta = torch.cat([delta, zero]).index_select(0, groups.dst)  # (B, T, out)
    return (out + delta.reshape(out.shape)).to(out.dtype)
