"""The parity gate: no sampler serves weights it disagrees with.

vLLM's sampled tokens are scored again by Treadle's own engine (the trainer's numbers:
prompt + completion, one prefill per sample) and the per-token logprobs compared. The
first vLLM result of every snapshot (a sampler refresh) is checked before it is handed
back, and then one result in `every_n`, or the first after `every_s` seconds. A check over
the thresholds of the model's dtype trips the snapshot: its requests go to Treadle's
sampler from then on, the checked result itself is sampled again there (no request
fails), and the evidence is logged and kept for /metrics and the result's metadata.

The KL estimate is k3 (Schulman's): with r = p_trainer / p_sampler at tokens drawn from the
sampler, mean(r - 1 - log r) estimates KL(sampler || trainer), never negative.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from treadle.engine.types import SampleRequest, SampleSpec

log = logging.getLogger("treadle.vllm")


@dataclass(frozen=True)
class Thresholds:
    """How far vLLM's logprobs may be from the trainer's, per token (nats)."""

    mean_abs: float
    max_abs: float
    kl: float


# fp32 kernels agree to ~1e-6 here; bf16 ones differ by rounding of every matmul (~1e-2).
# A wrong adapter or a stale cache is off by tenths of a nat.
DEFAULT_THRESHOLDS = {
    "float32": Thresholds(mean_abs=1e-4, max_abs=1e-3, kl=1e-5),
    "bfloat16": Thresholds(mean_abs=0.03, max_abs=0.3, kl=5e-3),
    "float16": Thresholds(mean_abs=0.01, max_abs=0.1, kl=1e-3),
}


def thresholds_for(dtype: str, max_abs: float | None = None) -> Thresholds:
    """The dtype's defaults; `max_abs` (ServerConfig parity_max_abs) rescales all three."""
    base = DEFAULT_THRESHOLDS.get(dtype.replace("torch.", ""), DEFAULT_THRESHOLDS["bfloat16"])
    if max_abs is None:
        return base
    k = max_abs / base.max_abs
    return Thresholds(base.mean_abs * k, max_abs, base.kl * k)


@dataclass
class Verdict:
    """One check: the disagreement measured on `tokens` sampled tokens of `key`."""

    key: str
    tokens: int
    mean_abs: float
    max_abs: float
    kl: float
    passed: bool
    at: float = field(default_factory=time.time)
    worst: list[tuple[int, float, float]] = field(default_factory=list)  # token, vLLM, trainer

    def summary(self) -> str:
        return (
            f"{self.key}: {self.tokens} tokens, mean |Δ| {self.mean_abs:.3g}, "
            f"max |Δ| {self.max_abs:.3g}, KL {self.kl:.3g} nats"
        )


def measure(
    key: str, sampler_lp: list[float], trainer_lp: list[float], tokens: list[int], t: Thresholds
) -> Verdict:
    diffs = [abs(a - b) for a, b in zip(sampler_lp, trainer_lp, strict=True)]
    n = len(diffs)
    if n == 0:
        return Verdict(key, 0, 0.0, 0.0, 0.0, True)
    kl = sum(math.expm1(b - a) - (b - a) for a, b in zip(sampler_lp, trainer_lp, strict=True)) / n
    worst = sorted(range(n), key=lambda i: -diffs[i])[:5]
    mean_abs, max_abs = sum(diffs) / n, max(diffs)
    passed = mean_abs <= t.mean_abs and max_abs <= t.max_abs and kl <= t.kl
    evidence = [(tokens[i], sampler_lp[i], trainer_lp[i]) for i in worst]
    return Verdict(key, n, mean_abs, max_abs, kl, passed, worst=evidence)


class ParityGate:
    """Which snapshots vLLM may serve, and when to check it again."""

    def __init__(
        self,
        thresholds: Thresholds,
        every_n: int = 16,
        every_s: float = 30.0,
        max_samples: int = 2,
        enabled: bool = True,
    ):
        self.thresholds = thresholds
        self.every_n = every_n
        self.every_s = every_s
        self.max_samples = max_samples  # samples of one request scored per check
        self.enabled = enabled
        self.tripped: dict[str, Verdict] = {}  # snapshot key → the check that tripped it
        self.last: dict[str, Verdict] = {}  # snapshot key → its last check
        self._since: dict[str, int] = {}  # results handed back unchecked since the last check
        self.checks = 0
        self.forgotten_trips = 0  # of snapshots freed since (a counter never goes down)

    def allows(self, key: str) -> bool:
        return key not in self.tripped

    def due(self, key: str) -> bool:
        """Whether the next result of `key` is checked (counts it either way)."""
        if not self.enabled:
            return False
        last = self.last.get(key)
        n = self._since.get(key, 0)
        if last is None or n + 1 >= self.every_n or time.time() - last.at >= self.every_s:
            self._since[key] = 0
            return True
        self._since[key] = n + 1
        return False

    def check(
        self,
        engine: Any,
        key: str,
        adapter: str | None,
        prompt: list[int],
        samples: list[tuple[list[int], list[float]]],
    ) -> Verdict:
        """Score (tokens, vLLM logprobs) samples with Treadle's engine; trip `key` over the
        thresholds. `adapter`: the engine id of the weights (None: the base model)."""
        samples = [s for s in samples if s[0]][: self.max_samples]
        sampler_lp, trainer_lp, tokens = [], [], []
        if samples:
            score = SampleSpec(max_tokens=0)
            requests = [
                SampleRequest(prompt + toks, params=score, adapter=adapter, prompt_logprobs=True)
                for toks, _ in samples
            ]
            for (toks, lps), result in zip(samples, engine.sample(requests), strict=True):
                sampler_lp += lps
                trainer_lp += [float(x) for x in result.prompt_logprobs[len(prompt) :]]
                tokens += toks
        verdict = measure(key, sampler_lp, trainer_lp, tokens, self.thresholds)
        self.checks += 1
        self.last[key] = verdict
        if not verdict.passed:
            self.tripped[key] = verdict
            log.warning(
                "parity gate tripped: vLLM disagrees with the trainer on %s (thresholds: "
                "mean %.3g, max %.3g, KL %.3g); its requests go to Treadle's sampler. Worst "
                "tokens (id, vLLM logprob, trainer logprob): %s",
                verdict.summary(),
                self.thresholds.mean_abs,
                self.thresholds.max_abs,
                self.thresholds.kl,
                verdict.worst,
            )
        return verdict

    def forget(self, key: str) -> None:
        self.forgotten_trips += key in self.tripped
        for d in (self.tripped, self.last, self._since):
            d.pop(key, None)
