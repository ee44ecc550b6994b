"""Per-row logit controls of the decode step: a constraint's mask, logit_bias and the
repetition, presence and frequency penalties. `treadle.engine.decode.Cohort.pick` applies
them, row by row, to the rows that ask for them, before temperature, min-p, top-k and
top-p (sample_utils.pick_tokens); the rows that ask for none are left as they were, so their
tokens and logprobs are bit for bit those of a batch without the controlled rows.

In this order, on one row's fp32 logits x (V,), as vLLM and HF order them:
1. the constraint (llguidance, treadle.engine.constraints): tokens that would leave its
   language get -inf;
2. logit_bias: x[t] += bias[t] (OpenAI's: -100 bans a token in practice, and the mask
   above makes a banned token impossible only where the constraint says so);
3. repetition_penalty r (HF's RepetitionPenaltyLogitsProcessor, CTRL's): every token seen
   in the prompt or sampled so far gets x / r where x > 0, else x * r;
4. presence and frequency penalties (OpenAI's): x[t] -= c[t] * frequency + (c[t] > 0) *
   presence, c[t] the times t was sampled so far in this row (the prompt not counted).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from treadle.engine import constraints
from treadle.engine.types import SampleSpec


class RowControls:
    """One decode row's controls and their state (its counts, its grammar matcher)."""

    def __init__(
        self,
        spec: SampleSpec,
        prompt: list[int],
        vocab_size: int,
        device: torch.device,
        matcher: Any = None,
        eos: list[int] | None = None,
    ):
        V = int(vocab_size)
        self.V = V
        self.matcher = matcher
        self.eos = list(eos or [])
        self.bias_ids = self.bias_vals = None
        if spec.logit_bias:
            ids = sorted(spec.logit_bias)
            self.bias_ids = torch.tensor(ids, dtype=torch.long, device=device)  # (b,)
            vals = [float(spec.logit_bias[t]) for t in ids]
            self.bias_vals = torch.tensor(vals, dtype=torch.float32, device=device)  # (b,)
        self.presence = float(spec.presence_penalty)
        self.frequency = float(spec.frequency_penalty)
        self.repetition = float(spec.repetition_penalty)
        self.counts = None  # (V,) fp32: times each token was sampled in this row
        if self.presence or self.frequency or self.repetition != 1.0:
            self.counts = torch.zeros(V, dtype=torch.float32, device=device)
        self.in_prompt = None  # (V,) bool: the repetition penalty counts the prompt too
        if self.repetition != 1.0:
            self.in_prompt = torch.zeros(V, dtype=torch.bool, device=device)
            self.in_prompt[torch.tensor(prompt, dtype=torch.long, device=device)] = True

    @classmethod
    def of(
        cls, engine: Any, spec: SampleSpec, prompt: list[int], eos: list[int], device: Any
    ) -> RowControls | None:
        """The controls of a request's first row (None where it has none); `copy` for the
        other samples, so that the grammar compiles once per request."""
        if not spec.has_controls:
            return None
        m = None
        if spec.constraint is not None:
            field = "sampling_params.constraint"
            m = constraints.matcher(
                engine.tokenizer, engine.vocab_size, eos, spec.constraint, field
            )
        return cls(spec, prompt, engine.vocab_size, device, m, eos)

    def copy(self) -> RowControls:
        """The same controls for a sibling row, with its own state."""
        out = object.__new__(RowControls)
        out.__dict__.update(self.__dict__)
        out.counts = None if self.counts is None else self.counts.clone()
        out.matcher = None if self.matcher is None else self.matcher.deep_copy()
        return out

    def allowed(self) -> torch.Tensor | None:
        """(V,) bool: the tokens the constraint allows next (None: no constraint). A matcher
        that allows nothing (it failed, e.g. out of its step's fuel) allows the EOS tokens
        alone, and `accept` ends the row after it."""
        if self.matcher is None:
            return None
        mask = np.zeros(self.V, dtype=bool)
        if not self.matcher.is_error():
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            mask = np.unpackbits(bits, bitorder="little")[: self.V].astype(bool)  # (V,)
        if not mask.any():
            mask[[t for t in self.eos if t < self.V] or [0]] = True
        return torch.from_numpy(mask)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """One row's fp32 logits (V,) → the logits it samples from (a new tensor)."""
        allowed = self.allowed()
        if allowed is not None:
            x = x.masked_fill(~allowed.to(x.device), float("-inf"))  # (V,)
        if self.bias_ids is not None:
            x = x.index_add(0, self.bias_ids, self.bias_vals)  # (V,)
        if self.counts is not None:
            sampled = self.counts > 0  # (V,)
            if self.in_prompt is not None:
                seen = sampled | self.in_prompt
                r = self.repetition
                x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
            x = x - self.frequency * self.counts - self.presence * sampled.float()
        return x

    def accept(self, token: int) -> bool:
        """Note the row's sampled token: → True where its constraint is now complete (or
        failed), which ends the row."""
        if self.counts is not None:
            self.counts[token] += 1
        if self.matcher is None:
            return False
        self.matcher.consume_token(token)
        return self.matcher.is_stopped() or self.matcher.is_error()


def controlled_logits(
    logits: torch.Tensor, rows: list[int], controls: list[RowControls]
) -> torch.Tensor:
    """(n, V) fp32 logits with each of `rows` replaced by what its controls make of it; the
    other rows are copied unchanged."""
    x = logits.float()  # (n, V)
    idx = torch.tensor(rows, dtype=torch.long, device=x.device)
    sub = torch.stack([c.apply(x[b]) for b, c in zip(rows, controls, strict=True)])  # (k, V)
    return x.index_put((idx,), sub)  # (n, V), a new tensor: the raw logits stay as they are
