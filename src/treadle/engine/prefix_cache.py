"""The sampler's prefix cache: prompt KV kept across requests, keyed by the weights that made it.

Multi-turn rollouts resend the conversation so far, GRPO groups resend one prompt; a
prefill of such a prompt starts from the keys and values an earlier request computed for
its longest cached prefix (treadle.engine.sample_prefill runs that pass).

An entry is (version, prompt tokens) → per layer keys and values (H, L, D). The version
names the weights the KV came from, so a changed weight never meets an old entry:
- a snapshot (frozen sampler weights): its bank object's `uid`, which no other adapter
  object ever gets, so a snapshot dropped and made again under the same id misses;
- a live adapter: its uid and the torch version counter of every A and B, which every
  in-place write bumps (an optim_step, a copy_), so each weight change is a new version;
- the base model: frozen for the engine's life.
Every version also carries the request's `prefix_scope` (the server puts the tenant there):
a tenant's rows only ever see entries its own requests made, so neither the hit count a
result reports nor its timing tells one tenant what another sent, even on the base model.

Lookups find the longest common prefix with any entry of the version: prompts are indexed
by blocks of BLOCK tokens (a chain of hashes, checked against the entry's tokens, so a
collision only costs a miss), then extended token by token. Memory is bounded by a byte
budget, least recently used entries going first; an entry that a longer prompt extends is
replaced by it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

BLOCK = 16  # tokens per index block; prompts shorter than this are never cached
# Attention kinds whose KV is a plain per-position tensor (a sliding window's too, kept whole:
# see sample_prefill); a model with any other layer kind (linear attention) is not cached.
CACHEABLE_LAYERS = frozenset({"full_attention", "sliding_attention"})


def cacheable_model(model: Any) -> str | None:
    """None when the model's KV can be cached; else why not."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = getattr(model, "config", None)
    if config is None:
        return "the model has no config"
    try:
        types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except Exception as e:  # noqa: BLE001 - an unknown config: do not cache
        return f"its layer kinds are unknown ({type(e).__name__})"
    other = sorted(set(types) - CACHEABLE_LAYERS)
    return f"it has {', '.join(other)} layers" if other else None


@dataclass(eq=False)
class _Entry:
    version: Hashable
    tokens: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys (H, L, D), values (H, L, Dv)
    nbytes: int
    blocks: list[tuple[Hashable, int]] = field(default_factory=list)  # its index keys


@dataclass
class Hit:
    """What a lookup found: an entry and how many leading tokens of the prompt it covers."""

    entry: _Entry | None = None
    tokens: int = 0


class PrefixCache:
    """Prompt KV of earlier requests, bounded by `budget_bytes` (LRU). Engine thread only."""

    def __init__(self, budget_bytes: int, block: int = BLOCK):
        self.budget = int(budget_bytes)
        self.block = block
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], _Entry] = OrderedDict()
        self._index: dict[tuple[Hashable, int], dict[int, _Entry]] = {}
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    # ---- versions ----
    @staticmethod
    def version(bank: Any, key: str | None, scope: str) -> Hashable | None:
        """The immutable name of the weights rows of `key` run with (None: do not cache)."""
        if key is None:
            return ("base", scope)
        if key not in bank:
            return None  # the prefill refuses it, naming it
        adapter = bank.get(key)
        if not adapter.trainable:
            return ("frozen", adapter.uid, scope)
        versions = tuple(p._version for p in adapter.parameters())
        return ("live", adapter.uid, versions, scope)

    # ---- lookups ----
    def _chain(self, version: Hashable, tokens: tuple[int, ...]) -> list[tuple[Hashable, int]]:
        """The index key of each whole block prefix of tokens."""
        keys, h = [], 0
        for end in range(self.block, len(tokens) + 1, self.block):
            h = hash((h, tokens[end - self.block : end]))
            keys.append((version, h))
        return keys

    def lookup(self, version: Hashable | None, prompt: tuple[int, ...]) -> Hit:
        """The entry sharing the longest prefix with the prompt (marked recently used)."""
        if version is None or self.budget <= 0:
            return Hit()
        found: dict[int, _Entry] = {}
        depth = 0
        for k, key in enumerate(self._chain(version, prompt), start=1):
            candidates = self._index.get(key)
            if not candidates:
                break
            found, depth = candidates, k
        best = Hit()
        for entry in found.values():
            n = depth * self.block
            if entry.tokens[:n] != prompt[:n]:
                continue  # a hash collision
            end = min(len(entry.tokens), len(prompt))
            while n < end and entry.tokens[n] == prompt[n]:
                n += 1
            if n > best.tokens:
                best = Hit(entry, n)
        if best.entry is not None:
            self._entries.move_to_end((best.entry.version, best.entry.tokens))
        return best

    # ---- storing ----
    def store(
        self,
        version: Hashable | None,
        tokens: tuple[int, ...],
        kv: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> bool:
        """Keep the prompt's KV (per layer (H, L, D) tensors the cache may hold on to) under
        `version`, evicting least recently used entries to fit; → whether it was kept.
        Entries of the version that are a prefix of `tokens` go: this one covers them."""
        if version is None or len(tokens) < self.block:
            return False
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.budget:
            return False
        key = (version, tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        entry = _Entry(version, tokens, kv, nbytes, self._chain(version, tokens))
        for covered in self._prefixes_of(entry):
            self._remove(covered)
        while self.bytes + nbytes > self.budget:
            self._remove(next(iter(self._entries.values())))
            self.evicted += 1
        self._entries[key] = entry
        for block_key in entry.blocks:
            self._index.setdefault(block_key, {})[id(entry)] = entry
        self.bytes += nbytes
        return True

    def _prefixes_of(self, entry: _Entry) -> list[_Entry]:
        out = []
        for block_key in entry.blocks:
            for other in self._index.get(block_key, {}).values():
                n = len(other.tokens)
                if other.version == entry.version and entry.tokens[:n] == other.tokens:
                    out.append(other)
        return list({id(e): e for e in out}.values())

    def _remove(self, entry: _Entry) -> None:
        if self._entries.pop((entry.version, entry.tokens), None) is None:
            return
        for block_key in entry.blocks:
            bucket = self._index.get(block_key)
            if bucket is not None:
                bucket.pop(id(entry), None)
                if not bucket:
                    del self._index[block_key]
        self.bytes -= entry.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.bytes = 0
