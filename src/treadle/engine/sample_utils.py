"""The sampler's pieces: token choice (temperature, top-k, top-p),
prompt logprobs, stop strings, and the preallocated KV cache. `treadle.engine.sample` puts
them together.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from treadle.engine.specs import validate_sample_request
from treadle.engine.types import SampleRequest
from treadle.errors import InvalidRequestError


def validate_request(engine: Any, req: SampleRequest, i: int) -> None:
    """Raise InvalidRequestError naming `requests[i].<field>` (the table the server's edge
    uses too: treadle.engine.specs)."""
    validate_sample_request(req, engine.vocab_size, engine.max_seq_len, f"requests[{i}].")


def pick_tokens(
    logits: torch.Tensor,
    greedy: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    all_greedy: bool = False,
    any_filter: bool = True,
    controlled: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    sampling_logprobs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Choose one token per row: (tokens (n,), their logprobs (n,), and, with
    `sampling_logprobs`, their logprobs under the distribution they were drawn from (n,)).

    logits (n, V) raw; `controlled` (n, V) the logits after each row's controls
    (treadle.engine.sample_controls), None where no row has any. Greedy rows (n,) bool take
    the argmax of those; other rows sample from softmax(logits / temperature) cut to the
    tokens with probability >= min_p x the top one's (min_p (n,), None where no row sets
    it), then to the top_k tokens, then to the smallest prefix with probability >= top_p
    (renormalised after top-k, as HF and vLLM do), by inverse CDF with their uniform (n,).
    The returned logprob is that of the raw distribution, see sample.py; the sampling one
    is 0 for greedy rows (the argmax is certain). `all_greedy` / `any_filter` let the
    caller skip work no row needs.
    """
    logits = logits.float()  # (n, V)
    logprobs = logits.log_softmax(-1)  # (n, V)
    x = logits if controlled is None else controlled  # (n, V)
    slp = None
    if all_greedy:
        tok = x.argmax(-1)  # (n,)
        if sampling_logprobs:
            slp = torch.zeros(tok.shape, dtype=torch.float32, device=tok.device)
    else:
        scaled = x / temperature[:, None]  # (n, V)
        if min_p is not None:
            probs = scaled.softmax(-1)  # (n, V)
            floor = min_p[:, None] * probs.amax(-1, keepdim=True)  # (n, 1); 0 keeps all
            scaled = scaled.masked_fill(probs < floor, float("-inf"))
        if any_filter:
            scaled = scaled.masked_fill(~_filter_mask(scaled, top_k, top_p), float("-inf"))
        # Inverse CDF in vocabulary order for every row, filtered or not, so that a row's
        # token never depends on which settings its batch companions use.
        tok = _inverse_cdf(scaled.softmax(-1), uniforms)  # (n,)
        tok = torch.where(greedy, x.argmax(-1), tok)
        if sampling_logprobs:
            slp = scaled.log_softmax(-1).gather(-1, tok[:, None]).squeeze(1)  # (n,)
            slp = torch.where(greedy, torch.zeros_like(slp), slp)
    lp = logprobs.gather(-1, tok[:, None]).squeeze(1)  # (n,)
    return tok, lp, slp


def _filter_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(n, V) bool: the tokens each row keeps after top-k then top-p; top_k = V is off."""
    V = scaled.shape[-1]
    vals, order = scaled.sort(-1, descending=True)  # (n, V)
    ranks = torch.arange(V, device=scaled.device)
    in_k = ranks[None, :] < top_k[:, None]  # (n, V)
    probs = vals.masked_fill(~in_k, float("-inf")).softmax(-1)  # (n, V) renormalised to top-k
    before = probs.cumsum(-1) - probs  # (n, V) mass of the better tokens
    keep_sorted = in_k & (before < top_p[:, None])  # the first token always stays
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index i with cdf[i-1] <= u * total < cdf[i] for each row of probs (n, V)."""
    cdf = probs.cumsum(-1)  # (n, V)
    x = uniforms * cdf[:, -1]  # (n,)
    idx = torch.searchsorted(cdf, x[:, None], right=True).squeeze(1)
    idx = idx.clamp(max=probs.shape[-1] - 1)
    # Rounding can land x on the total and pick a zero-probability tail token: take the mode.
    zero = probs.gather(-1, idx[:, None]).squeeze(1) <= 0
    return torch.where(zero, probs.argmax(-1), idx)


def prompt_logprobs_of_row(
    logits: torch.Tensor, prompt: tuple[int, ...] | list[int], T: int, k: int
) -> tuple[list[float | None], list[list[tuple[int, float]] | None] | None]:
    """Logprob of each prompt token given the ones before it, and the top k at each position.

    logits (T, V) of one left-padded prefill row; the first position gets None (nothing
    predicts it). Computed in fp32 like the sampled logprobs.
    """
    L = len(prompt)
    lp = logits[T - L : T - 1].float().log_softmax(-1)  # (L-1, V)
    target = torch.tensor(prompt[1:], dtype=torch.long, device=lp.device)
    chosen = lp.gather(-1, target[:, None]).squeeze(1).tolist()  # (L-1,)
    topk: list[list[tuple[int, float]] | None] | None = None
    if k > 0:
        vals, ids = lp.topk(k, dim=-1)  # (L-1, k)
        topk = [None] + [
            list(zip(i_row, v_row, strict=True))
            for i_row, v_row in zip(ids.tolist(), vals.tolist(), strict=True)
        ]
    return [None, *chosen], topk


def target_logprobs_of_row(logits: torch.Tensor, L: int, T: int, ids: np.ndarray) -> np.ndarray:
    """Logprobs of chosen tokens at each prompt position: (L-1, K) fp32, 0 where ids is -1.

    logits (T, V) of one left-padded prefill row of a prompt of length L; ids (L-1, K) int64,
    row i scored at prompt position i + 1 (what the logits of position i predict).
    """
    lp = logits[T - L : T - 1].float().log_softmax(-1)  # (L-1, V)
    idx = torch.as_tensor(ids, dtype=torch.long, device=lp.device)  # (L-1, K)
    got = lp.gather(-1, idx.clamp(min=0))  # (L-1, K)
    return got.masked_fill(idx < 0, 0.0).cpu().numpy().astype(np.float32)


def alt_tokens_of_row(
    logits: torch.Tensor, L: int, T: int, k: int, temperature: float, seed: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """k independent draws, with replacement, at each prompt position after the first.

    Draws come from softmax(logits / temperature) (the argmax k times when temperature is 0);
    the logprobs returned are those of the raw distribution, like sampled logprobs.
    → token ids (L-1, k) int64, logprobs (L-1, k) fp32.
    """
    lp = logits[T - L : T - 1].float().log_softmax(-1)  # (L-1, V)
    if temperature == 0:
        ids = lp.argmax(-1, keepdim=True).expand(-1, k)  # (L-1, k)
    else:
        gen = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
        probs = (lp / temperature).softmax(-1).cpu()  # (L-1, V)
        ids = torch.multinomial(probs, k, replacement=True, generator=gen).to(lp.device)
    vals = lp.gather(-1, ids)  # (L-1, k)
    return ids.cpu().numpy().astype(np.int64), vals.cpu().numpy().astype(np.float32)


class StopStringMatcher:
    """Follows one row's generated tokens and says when its text contains a stop string.

    Only the tail is decoded each step: the last few tokens span at least as many bytes as
    the longest stop string, plus slack for a multi-byte character split across tokens. A
    stop string therefore shows up in the tail on the very step its last token arrives.
    Special tokens are decoded as their text, so "<|im_end|>" works as a stop string.
    """

    def __init__(self, tokenizer: Any, stop_strings: list[str]):
        if tokenizer is None:
            raise InvalidRequestError("params.stop_strings need a tokenizer, the model has none")
        self.tokenizer = tokenizer
        self.stops = list(stop_strings)
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + 4
        self.tokens: list[int] = []

    def push(self, token: int) -> bool:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens[-self.window :], skip_special_tokens=False)
        return any(s in text for s in self.stops)


# ---- KV cache ----------------------------------------------------------------------------------
# The model builds an HF DynamicCache during the prefill; `preallocate` then swaps each plain
# DynamicLayer for a GrowingLayer sized for the whole decode, selecting the batch rows (one per
# sample) at the same time. Everything else about the cache (mask sizes, other layer kinds such
# as sliding windows) stays transformers' own.


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose keys / values live in one buffer sized for the decode.

    DynamicLayer concatenates on every step, copying the whole cache each time (quadratic in
    the sequence length); here a step writes one slot, and keys / values are views of the
    filled part.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        B, H, L, _ = keys.shape  # (B, H, L, D)
        k = keys.new_empty(B, H, capacity, keys.shape[-1])  # (B, H, C, D)
        v = values.new_empty(B, H, capacity, values.shape[-1])  # (B, H, C, Dv)
        k[:, :, :L] = keys
        v[:, :, :L] = values
        self._adopt(k, v, L)

    @classmethod
    def of_buffers(cls, k: torch.Tensor, v: torch.Tensor, length: int) -> GrowingLayer:
        """A layer over given (B, H, C, D) buffers whose first `length` slots are filled."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer._adopt(k, v, length)
        return layer

    def _adopt(self, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        self._k, self._v, self._len = k, v, length
        self.device, self.is_initialized = k.device, True
        self._views()

    def _views(self) -> None:
        self.keys = self._k[:, :, : self._len]  # (B, H, L, D)
        self.values = self._v[:, :, : self._len]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        if self._len + n > self._k.shape[2]:
            raise RuntimeError(f"cache capacity {self._k.shape[2]} exceeded")  # a sampler bug
        self._k[:, :, self._len : self._len + n] = key_states
        self._v[:, :, self._len : self._len + n] = value_states
        self._len += n
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len

    def batch_select_indices(self, indices: torch.Tensor, trim: int = 0) -> None:
        """Keep rows `indices`, and drop the first `trim` slots (padding for all of them)."""
        self._k, self._v = self._k[indices, :, trim:], self._v[indices, :, trim:]
        self._len -= trim
        self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._k = self._k.repeat_interleave(repeats, dim=0)
        self._v = self._v.repeat_interleave(repeats, dim=0)
        self._views()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the sampler never crops its cache")


def preallocate(cache: Any, rows: torch.Tensor | None, capacity: int) -> None:
    """Swap each plain DynamicLayer of an HF cache for a GrowingLayer holding `rows` of it.

    A sliding-window layer (gpt-oss's, Mistral's) becomes a GrowingLayer too, its slots
    before the window zeros: from here on it keeps every slot and the model's sliding mask
    (built from the config, on slot distances, which left padding leaves equal to token
    distances) does the windowing. Its cache is then as long as a full layer's, not the
    window, but it joins other cohorts (continuous batching) instead of waiting for them.
    Other layer kinds (linear attention) keep their own update and are only row-selected.
    `rows` None keeps every row.
    """
    if cache is None:
        return
    if not hasattr(cache, "layers"):  # a cache without per-layer objects (older transformers)
        if rows is not None:
            cache.batch_select_indices(rows)
        return
    for i, layer in enumerate(cache.layers):
        plain = type(layer) is DynamicLayer
        if (plain or type(layer) is DynamicSlidingWindowLayer) and layer.is_initialized:
            k, v = layer.keys, layer.values  # (B, H, L, D); a window's last slots only
            if rows is not None:
                k, v = k.index_select(0, rows), v.index_select(0, rows)
            dropped = layer.get_seq_length() - k.shape[2]  # slots the window let go
            if dropped:
                k, v = (F.pad(t, (0, 0, dropped, 0)) for t in (k, v))  # (B, H, L, D)
            cache.layers[i] = GrowingLayer(k, v, capacity)
        elif rows is not None:
            layer.batch_select_indices(rows)


def growing(cache: Any) -> bool:
    """Whether every layer of the cache is a GrowingLayer: rows of two such caches can be
    joined (`join_caches`) and leading padding cut (`select_cache_rows`)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(isinstance(layer, GrowingLayer) for layer in layers)


def select_cache_rows(cache: Any, rows: torch.Tensor, trim: int) -> int:
    """Keep `rows` of the cache and drop its first `trim` slots where it can (every layer a
    GrowingLayer); → the slots dropped (0 where it cannot)."""
    if cache is None:
        return 0
    if not growing(cache):
        cache.batch_select_indices(rows)
        return 0
    for layer in cache.layers:
        layer.batch_select_indices(rows, trim)
    return trim


def join_caches(
    a: Any, rows_a: torch.Tensor, start_a: int, b: Any, length: int, capacity: int
) -> Any:
    """Rows `rows_a` of cache a (their slots from start_a on) and every row of cache b, in
    new buffers of `capacity` slots, both right-aligned to end at slot `length`; the slots
    before them are zeros (the caller masks them). Both caches `growing`; → a, rebuilt."""
    joined = []
    for la, lb in zip(a.layers, b.layers, strict=True):
        bufs = []
        for xa, xb in ((la.keys, lb.keys), (la.values, lb.values)):
            xa = xa.index_select(0, rows_a)[:, :, start_a:]  # (na, H, La, D)
            na, nb, H, D = xa.shape[0], xb.shape[0], xa.shape[1], xa.shape[3]
            buf = xa.new_zeros(na + nb, H, capacity, D)  # (n, H, C, D)
            buf[:na, :, length - xa.shape[2] : length] = xa
            buf[na:, :, length - xb.shape[2] : length] = xb
            bufs.append(buf)
        joined.append(GrowingLayer.of_buffers(*bufs, length))
    a.layers[:] = joined  # only once every buffer is made: a failure leaves a as it was
    return a
