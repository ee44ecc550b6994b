"""Phase 3 of DecodeBatch.add (treadle.engine.sample) with a prefix cache: the generating
prompts' prefill, starting each from the KV of its longest cached prefix.

The rows split in two passes: those whose cache hit is worth it (at least a block of
tokens), and the rest (among them every row whose requests want logits at every prompt
position: those need the whole prompt run). Each pass is one left-padded forward. In the
hit pass every row feeds the same number S of trailing tokens, the most any row has
uncached; the columns before them come from the cache (a row whose uncached part is
shorter than S feeds some cached tokens again: the same values, and a row's numbers never
depend on its batch). Both passes' caches are then right-aligned into one, as one prefill
of every row would have left it, and every prompt's KV is stored for later requests.

Sliding-window layers keep every position here (a full layer's cache, with the model's
sliding mask doing the windowing, as in the decode steps: sample_utils.preallocate), so a
stored entry serves any prefix of its prompt. The scores equal an uncached prefill's up to
the rounding of differently shaped matmuls, as between any two batch compositions.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from treadle.engine.decode import cache_arg
from treadle.engine.prefix_cache import Hit, PrefixCache
from treadle.engine.sample_utils import GrowingLayer

Row = tuple[str | None, tuple[int, ...]]  # (adapter key, prompt)
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (P, H, T, D)


def prefill_with_prefixes(
    engine: Any,
    pc: PrefixCache,
    rows: list[Row],
    scopes: list[list[str]],
    needs_full: list[bool],
    full: bool,
    want_cache: bool,
) -> tuple[torch.Tensor, Any, int, list[dict[str, int]]]:
    """One prefill of distinct (adapter, prompt) rows: (logits (P, T, V) with `full` else
    (P, 1, V), the cache (None unless want_cache), padded length T, and per row and scope
    the prompt tokens that scope's cache held: what a request of that scope reports).

    `scopes[r]`: the prefix scopes of row r's requests (each sees only its own entries;
    the row runs from the best of them). `needs_full[r]`: row r needs every position's
    logits, so it runs whole."""
    versions: list[dict[str, Hashable | None]] = []
    hits: list[dict[str, Hit]] = []
    for (adapter, prompt), row_scopes in zip(rows, scopes, strict=True):
        short = len(prompt) < pc.block  # never cached
        v = {s: None if short else pc.version(engine.bank, adapter, s) for s in row_scopes}
        versions.append(v)
        hits.append({s: pc.lookup(v[s], prompt) for s in row_scopes})
    reported, best = [], []
    for r, (_, prompt) in enumerate(rows):
        cap = 0 if needs_full[r] else len(prompt) - 1  # at least one token runs
        reported.append({s: min(h.tokens, cap) for s, h in hits[r].items()})
        top = max(hits[r].values(), key=lambda h: h.tokens, default=Hit())
        best.append(Hit(top.entry, min(top.tokens, cap)))
    hit_rows = [r for r in range(len(rows)) if best[r].tokens >= pc.block]
    miss_rows = [r for r in range(len(rows)) if best[r].tokens < pc.block]
    passes = []
    for group, use in ((miss_rows, False), (hit_rows, True)):
        if group:
            logits, kv, T = _pass(
                engine,
                [rows[r] for r in group],
                [best[r] if use else Hit() for r in group],
                full and not use,
            )
            passes.append((group, logits, kv, T))
            _store(pc, [rows[r] for r in group], [versions[r] for r in group],
                   [hits[r] for r in group], kv, T)  # fmt: skip
    T = max(p[3] for p in passes)
    logits = _merge_logits(passes, len(rows), T, full)
    cache = _merge_cache(passes, len(rows), T) if want_cache else None
    return logits, cache, T, reported


def _pass(
    engine: Any, rows: list[Row], hits: list[Hit], full: bool
) -> tuple[torch.Tensor, KV, int]:
    """One left-padded forward of rows whose first hits[r].tokens positions come from the
    cache: (logits (P, S or 1, V), per layer KV (P, H, T, D), padded length T)."""
    device = torch.device(engine.device)
    lens = [len(p) for _, p in rows]
    P, T = len(rows), max(lens)
    S = max(n - h.tokens for n, h in zip(lens, hits, strict=True))  # columns fed
    past = T - S
    ids = torch.zeros(P, S, dtype=torch.long)  # (P, S); pad id 0 is masked out anyway
    for r, (_, prompt) in enumerate(rows):
        fed = prompt[max(len(prompt) - S, 0) :]
        ids[r, S - len(fed) :] = torch.tensor(fed, dtype=torch.long)
    lens_t = torch.tensor(lens, dtype=torch.long)
    pos = torch.arange(T)[None, :] - (T - lens_t)[:, None]  # (P, T), negative on padding
    mask = (pos >= 0).long()  # (P, T)
    pos = pos[:, past:].clamp(min=0)  # (P, S)
    cache = DynamicCache()  # every layer a plain one: sliding windows keep every position
    if past:
        cache.layers.extend(_past_layers(hits, lens, S, past, T, device))
    with engine.bank.rows([a for a, _ in rows]):
        out = engine.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=pos.to(device),
            use_cache=True,
            **{cache_arg(type(engine.model)): cache},
            logits_to_keep=0 if full else 1,
        )
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    return out.logits, kv, T


def _past_layers(
    hits: list[Hit], lens: list[int], S: int, past: int, T: int, device: torch.device
) -> list[GrowingLayer]:
    """GrowingLayers of capacity T whose first `past` slots hold each row's cached tokens
    before its fed ones, right-aligned (zeros before: masked)."""
    some = next(h.entry for h in hits if h.entry is not None)
    layers = []
    for layer, (k0, v0) in enumerate(some.kv):
        k = k0.new_zeros(len(hits), k0.shape[0], T, k0.shape[-1], device=device)  # (P, H, T, D)
        v = v0.new_zeros(len(hits), v0.shape[0], T, v0.shape[-1], device=device)
        for r, (n, h) in enumerate(zip(lens, hits, strict=True)):
            u = max(n - S, 0)  # cached tokens this row takes (at most h.tokens)
            if u:
                ek, ev = h.entry.kv[layer]  # type: ignore[union-attr]
                k[r, :, past - u : past] = ek[:, :u]
                v[r, :, past - u : past] = ev[:, :u]
        layers.append(GrowingLayer.of_buffers(k, v, past))
    return layers


def _store(
    pc: PrefixCache,
    rows: list[Row],
    versions: list[dict[str, Hashable | None]],
    hits: list[dict[str, Hit]],
    kv: KV,
    T: int,
) -> None:
    """Keep each prompt's KV under each scope whose cache did not hold all of it yet."""
    for r, (_, prompt) in enumerate(rows):
        todo = [s for s, h in hits[r].items() if h.tokens < len(prompt) and versions[r][s]]
        if not todo or len(prompt) < pc.block:
            continue
        L = len(prompt)
        mine = [(k[r, :, T - L :].clone(), v[r, :, T - L :].clone()) for k, v in kv]  # (H, L, D)
        for s in todo:
            pc.store(versions[r][s], prompt, mine)


def _merge_logits(passes: list, P: int, T: int, full: bool) -> torch.Tensor:
    """The passes' logits as one prefill's: (P, T, V) with full (positions a pass did not
    compute are zeros: no row needing them ran there), else (P, 1, V)."""
    if len(passes) == 1 and (not full or passes[0][3] == T):
        return passes[0][1]
    some = passes[0][1]
    out = some.new_zeros(P, T if full else 1, some.shape[-1])  # (P, T or 1, V)
    for group, logits, _, _ in passes:
        idx = torch.tensor(group, device=out.device)
        if full and logits.shape[1] > 1:
            out[idx, T - logits.shape[1] :] = logits
        else:
            out[idx, -1] = logits[:, -1]
    return out


def _merge_cache(passes: list, P: int, T: int) -> DynamicCache:
    """The passes' KV right-aligned in one cache of plain layers (P, H, T, D), rows in order."""
    n_layers = len(passes[0][2])
    cache = DynamicCache()
    for layer in range(n_layers):
        if len(passes) == 1:
            k, v = passes[0][2][layer]
        else:
            k0, v0 = passes[0][2][layer]
            k = k0.new_zeros(P, k0.shape[1], T, k0.shape[-1])  # (P, H, T, D)
            v = v0.new_zeros(P, v0.shape[1], T, v0.shape[-1])
            for group, _, kv, Tg in passes:
                idx = torch.tensor(group, device=k.device)
                k[idx, :, T - Tg :] = kv[layer][0]
                v[idx, :, T - Tg :] = kv[layer][1]
        plain = DynamicLayer()
        plain.keys, plain.values = k, v
        plain.device, plain.is_initialized = k.device, True
        cache.layers.append(plain)
    return cache
