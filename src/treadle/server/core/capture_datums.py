"""A captured trajectory as training data: the tokens the model saw and produced, never
re-tokenized.

A trajectory is the completions served under one trajectory id, in the order they were
served. Each turn's prompt is the chat template's rendering of the conversation so far, so
turn k+1's prompt usually starts with turn k's prompt and sampled tokens, followed by what
came back (a tool result, the user's next message) and the next generation prompt. Turns
that chain like that become one datum; where the template renders an earlier answer with
other tokens than the model sampled (it reformats a tool call, strips a thinking block), the
chain breaks and a new datum starts, so every datum holds exactly the tokens that were
sampled and the prompts exactly as they were rendered.

    tokens      p1 ........ s1 ..... p2-rest ... s2 ......
    weights     0 ......... 1 ...... 0 ......... 1 .......   (targets: tokens[1:])
    logprobs    0 ......... q ...... 0 ......... q .......   (the sampler's)
    advantages  0 ......... A ...... 0 ......... A .......

Provenance (what stable_reinforce needs): every position names the recorded sequence it came
from, as a prompt or a sampled span, when every turn of the datum was sampled by a training
session's weights (their sequences are recorded); otherwise the datum carries none, and the
IS losses (importance_sampling, ppo, cispo) use its `logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treadle.types import Datum, ModelInput, PromptProvenanceSpan, SampledProvenanceSpan


@dataclass
class Turn:
    """One captured completion, as read back."""

    completion_id: str
    prompt_T: list[int]
    tokens_T: list[int]
    logprobs_T: list[float]
    sequence_id: str | None
    session_id: str | None


@dataclass
class _Segment:
    """A run of a datum's tokens: a turn's prompt [offset, offset + length) or its sampled
    tokens [offset, offset + length)."""

    sequence_id: str | None
    sampled: bool
    offset: int
    length: int


@dataclass
class _Chain:
    tokens: list[int]
    sampled: list[bool]
    logprobs: list[float]
    segments: list[_Segment]


def chains(turns: list[Turn]) -> list[_Chain]:
    """The trajectory's turns joined where each prompt extends the tokens before it."""
    out: list[_Chain] = []
    for turn in turns:
        last = out[-1] if out else None
        n = len(last.tokens) if last is not None else 0
        if last is not None and turn.prompt_T[:n] == last.tokens:
            rest = turn.prompt_T[n:]
            chain, start = last, n
        else:
            rest = list(turn.prompt_T)
            chain, start = _Chain([], [], [], []), 0
            out.append(chain)
        if rest:
            chain.segments.append(_Segment(turn.sequence_id, False, start, len(rest)))
        chain.tokens += rest
        chain.sampled += [False] * len(rest)
        chain.logprobs += [0.0] * len(rest)
        if turn.tokens_T:
            chain.segments.append(_Segment(turn.sequence_id, True, 0, len(turn.tokens_T)))
        chain.tokens += turn.tokens_T
        chain.sampled += [True] * len(turn.tokens_T)
        chain.logprobs += list(turn.logprobs_T)
    return out


def _cut(segments: list[_Segment], start: int, stop: int) -> list:
    """Provenance spans for datum positions [start, stop) of a chain."""
    spans, pos = [], 0
    for seg in segments:
        lo, hi = max(start, pos), min(stop, pos + seg.length)
        if lo < hi:
            kind = SampledProvenanceSpan if seg.sampled else PromptProvenanceSpan
            offset = seg.offset + (lo - pos)
            spans.append(kind(sequence_id=seg.sequence_id, offset=offset, length=hi - lo))
        pos += seg.length
    return spans


def trajectory_datums(turns: list[Turn], advantage: float) -> list[Datum]:
    """The datums of one trajectory with `advantage` on every sampled token."""
    out = []
    for chain in chains(turns):
        if len(chain.tokens) < 2 or not any(chain.sampled[1:]):
            continue
        tokens = np.asarray(chain.tokens, dtype=np.int64)  # (T,)
        mask = np.asarray(chain.sampled[1:], dtype=np.float32)  # (T-1,): targets are tokens[1:]
        datum = Datum(
            model_input=ModelInput.from_ints(tokens[:-1].tolist()),
            loss_fn_inputs={
                "target_tokens": tokens[1:],
                "weights": mask,
                "logprobs": np.asarray(chain.logprobs[1:], dtype=np.float32) * mask,
                "advantages": mask * np.float32(advantage),
            },
        )
        if all(seg.sequence_id is not None for seg in chain.segments):
            T = len(chain.tokens)
            datum = datum.with_provenance(
                _cut(chain.segments, 0, T - 1), _cut(chain.segments, 1, T)
            )
        out.append(datum)
    return out


def advantages(
    rewards: dict[str, float], groups: dict[str, str | None], normalize_std: bool = False
) -> dict[str, float]:
    """GRPO's advantages: a trajectory's reward minus the mean of its group (divided by the
    group's standard deviation with `normalize_std`); a trajectory in no group keeps its
    reward as its advantage."""
    members: dict[str, list[str]] = {}
    for tid, group in groups.items():
        if group is not None:
            members.setdefault(group, []).append(tid)
    out = {tid: r for tid, r in rewards.items() if groups.get(tid) is None}
    for tids in members.values():
        r = np.asarray([rewards[t] for t in tids], dtype=np.float64)
        a = r - r.mean()
        if normalize_std:
            a = a / (r.std() + 1e-6)
        out.update({t: float(x) for t, x in zip(tids, a, strict=True)})
    return out
