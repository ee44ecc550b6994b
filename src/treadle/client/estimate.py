"""Cost before the run: the tokens a training run will send, priced with the server's table.

A run's plan is its tokens per counter (prefill, sample, train), each a range: what the data
fixes is exact (the tokens of an SFT batch, the prompts of an RL step), what the model decides
is bounded (a sampled completion is 1 to max_tokens tokens; an RL group whose rewards are all
equal trains nothing; a prompt sent again to the same weights may be held by the server's
prefix cache, metered as cached prefill at its lower price). The estimate is the plan priced: low, expected and high cost, the
metered cost of the run falls between low and high.

    plan = rl_plan("treadle/tiny-llama", prompts_S_P, group_size=8, max_tokens=64)
    est = svc.estimate_cost(plan)          # ServiceClient: the server's price table
    print(est.summary())                   # treadle estimate prints the same

`prompts_S_P`: the prompt lengths of each step's problems (S steps, P prompts each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

COUNTERS = ("prefill", "sample", "train")
EXPECTED_FILL = 0.5  # a completion's expected share of max_tokens (no better prior)


@dataclass(frozen=True)
class Span:
    """A number known to lie in [low, high], with an expected value."""

    low: float = 0.0
    expected: float = 0.0
    high: float = 0.0

    def __add__(self, other: Span) -> Span:
        return Span(self.low + other.low, self.expected + other.expected, self.high + other.high)

    def scaled(self, k: float) -> Span:
        return Span(self.low * k, self.expected * k, self.high * k)

    def __contains__(self, x: float) -> bool:
        return self.low - 1e-9 <= x <= self.high + 1e-9


def exact(n: float) -> Span:
    return Span(n, n, n)


def _prefill(prompts_P: Sequence[int], requests: int) -> Span:
    """Prompt tokens prefilled by `requests` requests of each prompt: all of them, or, where
    the server's prefix cache holds a prompt (sent before to the same weights, or sharing a
    prefix with one that was), as little as its last token."""
    every = requests * sum(prompts_P)
    return Span(requests * len(prompts_P), every, every)


@dataclass
class RunPlan:
    """The tokens a run will send, per counter, summed over its steps."""

    model: str
    steps: int
    tokens: dict[str, Span] = field(default_factory=lambda: {c: Span() for c in COUNTERS})
    notes: list[str] = field(default_factory=list)

    def add(self, counter: str, span: Span) -> None:
        self.tokens[counter] = self.tokens[counter] + span


@dataclass
class CostEstimate:
    plan: RunPlan
    price: dict[str, float]  # $ per million tokens of each counter
    cost_usd: Span

    def summary(self) -> str:
        p = self.plan
        lines = [f"estimate for {p.steps} steps of {p.model}:"]
        for c in COUNTERS:
            t = p.tokens[c]
            lines.append(
                f"  {c:>7} tokens {t.expected:>14,.0f}  ({t.low:,.0f} to {t.high:,.0f})"
                f"  at ${self.price.get(c, 0.0):g}/M"
            )
        c = self.cost_usd
        lines.append(f"  cost ${c.expected:.6f}  (${c.low:.6f} to ${c.high:.6f})")
        lines += [f"  note: {n}" for n in p.notes]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "model": self.plan.model,
            "steps": self.plan.steps,
            "tokens": {c: vars(s) for c, s in self.plan.tokens.items()},
            "price_per_million": self.price,
            "cost_usd": vars(self.cost_usd),
            "notes": self.plan.notes,
        }


def price(plan: RunPlan, prices: dict[str, float] | None) -> CostEstimate:
    """The plan's cost at `prices` ($ per million tokens per counter; None: not charged)."""
    table = {c: float((prices or {}).get(c, 0.0)) for c in COUNTERS}
    cost = Span()
    for c in COUNTERS:
        cost = cost + plan.tokens[c].scaled(table[c] / 1e6)
    if prices is None:
        plan.notes.append(f"the server has no price for {plan.model}: it is not charged")
    return CostEstimate(plan, table, cost)


# ---- plans of the common loops ---------------------------------------------------------


def sft_plan(model: str, batches_S_B: Sequence[Sequence[int]]) -> RunPlan:
    """Supervised steps: each step's datums' model-input lengths (known from the data)."""
    plan = RunPlan(model, len(batches_S_B))
    plan.add("train", exact(sum(sum(b) for b in batches_S_B)))
    return plan


def sample_span(prompts: int, samples: int, max_tokens: int) -> Span:
    """Tokens sampled by `prompts` requests of `samples` completions of 1 to max_tokens."""
    n = prompts * samples
    return Span(n, n * max(1.0, EXPECTED_FILL * max_tokens), n * max_tokens)


def rl_plan(
    model: str,
    prompts_S_P: Sequence[Sequence[int]],
    group_size: int,
    max_tokens: int,
    eval_prompts_P: Sequence[int] = (),
    evals: int = 0,
    eval_samples: int = 0,
    greedy_eval: bool = True,
) -> RunPlan:
    """Single-turn RL (GRPO): each step samples `group_size` completions of each prompt
    (one request per prompt: its prompt is prefilled once) and trains on every completion
    of a group whose rewards differ (datum: prompt + completion - 1 tokens). `evals`
    evaluations sample `eval_samples` completions (and one greedy) of each eval prompt."""
    plan = RunPlan(model, len(prompts_S_P))
    for prompts_P in prompts_S_P:
        plan.add("prefill", _prefill(prompts_P, 1))
        plan.add("sample", sample_span(len(prompts_P), group_size, max_tokens))
        full = sum(group_size * (p + max_tokens - 1) for p in prompts_P)
        expected = sum(group_size * (p + EXPECTED_FILL * max_tokens - 1) for p in prompts_P)
        plan.add("train", Span(0, expected, full))
    if evals and eval_prompts_P:
        requests = 1 + int(greedy_eval)
        samples = eval_samples + int(greedy_eval)
        plan.add("prefill", _prefill(eval_prompts_P, requests).scaled(evals))
        plan.add("sample", sample_span(len(eval_prompts_P), samples, max_tokens).scaled(evals))
    plan.notes.append(
        "prompts: the prefix cache may hold all of a prompt but its last token (low); held"
        " tokens are metered as cached prefill, at its lower price"
    )
    plan.notes.append(
        f"completions: 1 to {max_tokens} tokens (expected {EXPECTED_FILL:.0%} of max_tokens);"
        " a group whose rewards are all equal trains nothing (low: none trains)"
    )
    return plan
