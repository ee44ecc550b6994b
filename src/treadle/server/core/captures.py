"""Capture sessions: every completion served under one is recorded token-exactly, so that an
agent written against the OpenAI or Anthropic API can be trained without its author ever
tokenizing anything.

    capture = svc.create_capture_session()                  # or any name, sent as a header
    client = openai.OpenAI(base_url=..., default_headers=capture.headers("rollout-7"))
    ... the agent runs, turn after turn, tools and all ...
    capture.set_reward("rollout-7", 1.0, group="problem-3")
    datums = capture.export_datums()                         # ready for forward_backward

A /v1 or /v1/messages request with `X-Treadle-Capture: <name>` (and, to join turns into one
trajectory, `X-Treadle-Trajectory: <id>`) is served as usual and recorded: the rendered
prompt tokens, the sampled tokens, the sampler's logprob of each, the weights that sampled
them (`sampler_version`) and, when those are a training session's, the sequence id that
stable_reinforce's provenance names (the op is filed with record_stability_info). The record
is committed before the response goes out: what a client was answered is kept, across a
restart. A header naming a capture the tenant does not have yet creates it.

Names are per tenant: another tenant's capture of the same name is another capture, and
nothing here reads or rewards a row of another tenant (every query filters on tenant_id).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import re
from dataclasses import dataclass

import numpy as np
from sqlalchemy import Connection, delete, func, insert, select

from treadle.errors import InvalidRequestError, NotFoundError
from treadle.server.core.capture_datums import Turn, advantages, trajectory_datums
from treadle.server.storage.database import Store
from treadle.server.storage.journal import Journal
from treadle.server.storage.rows import (
    CapturedCompletionRow,
    CaptureRewardRow,
    CaptureRow,
    RequestRow,
    new_id,
    utcnow,
)
from treadle.types import Datum

CAPTURES = CaptureRow.__table__
COMPLETIONS = CapturedCompletionRow.__table__
REWARDS = CaptureRewardRow.__table__
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
MAX_REWARDS = 10_000  # per call


@dataclass(frozen=True)
class CaptureRef:
    """Where a request's completion is recorded (its headers, checked)."""

    tenant_id: str
    capture_id: str
    trajectory_id: str | None  # None: the completion is a trajectory of its own


@dataclass
class Captured:
    """One completion to record."""

    model: str
    base_model: str
    sampler_version: str
    session_id: str | None
    sequence_id: str | None
    prompt_T: list[int]
    tokens_T: list[int]
    logprobs_T: list[float]
    finish_reason: str


def check_name(value: str, field: str) -> str:
    if not NAME.match(value):
        raise InvalidRequestError(
            f"{field}: expected 1-128 characters of letters, digits and ._:@- (starting "
            f"with a letter or digit), got {value!r}"
        )
    return value


class Captures:
    def __init__(self, store: Store, journal: Journal):
        self.store, self.journal = store, journal

    # ---- sessions ----
    async def create(self, tenant_id: str, capture_id: str | None = None) -> str:
        """Create a capture session (an existing one of this tenant is kept): → its name."""
        name = check_name(capture_id, "capture_id") if capture_id else f"cap-{new_id()}"
        await self.journal.run(functools.partial(_ensure, tenant_id=tenant_id, capture_id=name))
        return name

    async def require(self, tenant_id: str, capture_id: str) -> None:
        found = await asyncio.to_thread(self._exists, tenant_id, capture_id)
        if not found:
            raise NotFoundError(f"capture_id: capture session {capture_id!r} not found")

    def _exists(self, tenant_id: str, capture_id: str) -> bool:
        with self.store.engine.connect() as conn:
            return _exists(conn, tenant_id, capture_id)

    # ---- recording ----
    async def record(self, ref: CaptureRef, done: Captured) -> str:
        """Commit one completion; → its completion id (its trajectory's, when it has none)."""
        cid = f"cmp-{new_id()}"
        values = {
            "completion_id": cid,
            "tenant_id": ref.tenant_id,
            "capture_id": ref.capture_id,
            "trajectory_id": ref.trajectory_id or cid,
            "model": done.model,
            "base_model": done.base_model,
            "sampler_version": done.sampler_version,
            "session_id": done.session_id,
            "sequence_id": done.sequence_id,
            "prompt": np.asarray(done.prompt_T, dtype="<i4").tobytes(),
            "tokens": np.asarray(done.tokens_T, dtype="<i4").tobytes(),
            "logprobs": np.asarray(done.logprobs_T, dtype="<f4").tobytes(),
            "finish_reason": done.finish_reason,
            "created_at": utcnow(),
        }
        await self.journal.run(lambda conn: conn.execute(insert(COMPLETIONS), values))
        return cid

    async def optim_steps(self, model_id: str) -> int:
        """Optimizer steps a training model has finished: its weights' version."""
        stmt = select(func.count()).where(
            (RequestRow.model_id == model_id)
            & (RequestRow.kind == "optim_step")
            & (RequestRow.status == "done")
        )
        return int(await asyncio.to_thread(self._scalar, stmt))

    def _scalar(self, stmt) -> int:
        with self.store.engine.connect() as conn:
            return conn.execute(stmt).scalar() or 0

    # ---- reading, rewarding, exporting ----
    async def completions(self, tenant_id: str, capture_id: str) -> list[dict]:
        await self.require(tenant_id, capture_id)
        rows = await asyncio.to_thread(self._rows, tenant_id, capture_id)
        return [_public(r) for r in rows]

    def _rows(self, tenant_id: str, capture_id: str) -> list:
        stmt = (
            select(COMPLETIONS)
            .where(
                (COMPLETIONS.c.tenant_id == tenant_id) & (COMPLETIONS.c.capture_id == capture_id)
            )
            .order_by(COMPLETIONS.c.created_at, COMPLETIONS.c.completion_id)
        )
        with self.store.engine.connect() as conn:
            return list(conn.execute(stmt))

    async def set_rewards(self, tenant_id: str, capture_id: str, items: list[dict]) -> int:
        """Attach rewards (a later one replaces an earlier one); every trajectory must have
        been captured here. → how many were set."""
        if len(items) > MAX_REWARDS:
            raise InvalidRequestError(f"rewards: at most {MAX_REWARDS} per call, got {len(items)}")
        await self.require(tenant_id, capture_id)
        known = {
            r.trajectory_id for r in await asyncio.to_thread(self._rows, tenant_id, capture_id)
        }
        values = []
        for i, item in enumerate(items):
            tid, reward = item.get("trajectory_id"), item.get("reward")
            if tid not in known:
                raise NotFoundError(
                    f"rewards[{i}].trajectory_id: {tid!r} has no completion in capture "
                    f"session {capture_id!r}"
                )
            if not isinstance(reward, int | float) or not np.isfinite(reward):
                raise InvalidRequestError(
                    f"rewards[{i}].reward: expected a finite number, got {reward!r}"
                )
            group = item.get("group")
            if group is not None and not isinstance(group, str):
                raise InvalidRequestError(f"rewards[{i}].group: expected a string, got {group!r}")
            values.append(
                {
                    "tenant_id": tenant_id,
                    "capture_id": capture_id,
                    "trajectory_id": tid,
                    "reward": float(reward),
                    "group_id": group,
                    "created_at": utcnow(),
                }
            )
        await self.journal.run(functools.partial(_put_rewards, values=values))
        return len(values)

    async def export(
        self,
        tenant_id: str,
        capture_id: str,
        trajectory_ids: list[str] | None = None,
        normalize_std: bool = False,
    ) -> tuple[list[Datum], list[dict]]:
        """Datums of the rewarded trajectories (or of those named, which must be rewarded),
        with GRPO advantages within each group; → (datums, one summary per trajectory)."""
        await self.require(tenant_id, capture_id)
        rows, rewarded = await asyncio.to_thread(self._export_rows, tenant_id, capture_id)
        wanted = list(rewarded) if trajectory_ids is None else trajectory_ids
        for i, tid in enumerate(wanted):
            if tid not in rewarded:
                raise InvalidRequestError(
                    f"trajectory_ids[{i}]: {tid!r} has no reward in capture session "
                    f"{capture_id!r} (set_reward first)"
                )
        rewards = {t: rewarded[t][0] for t in wanted}
        adv = advantages(rewards, {t: rewarded[t][1] for t in wanted}, normalize_std)
        by_traj: dict[str, list[Turn]] = {}
        for r in rows:
            by_traj.setdefault(r.trajectory_id, []).append(_turn(r))
        datums, summary = [], []
        for tid in wanted:
            made = trajectory_datums(by_traj.get(tid, []), adv[tid])
            datums += made
            summary.append(
                {
                    "trajectory_id": tid,
                    "reward": rewards[tid],
                    "group": rewarded[tid][1],
                    "advantage": adv[tid],
                    "turns": len(by_traj.get(tid, [])),
                    "datums": len(made),
                }
            )
        return datums, summary

    def _export_rows(self, tenant_id: str, capture_id: str) -> tuple[list, dict]:
        stmt = select(REWARDS).where(
            (REWARDS.c.tenant_id == tenant_id) & (REWARDS.c.capture_id == capture_id)
        )
        with self.store.engine.connect() as conn:
            rewarded = {r.trajectory_id: (r.reward, r.group_id) for r in conn.execute(stmt)}
        return self._rows(tenant_id, capture_id), rewarded


def _exists(conn: Connection, tenant_id: str, capture_id: str) -> bool:
    stmt = select(CAPTURES.c.capture_id).where(
        (CAPTURES.c.tenant_id == tenant_id) & (CAPTURES.c.capture_id == capture_id)
    )
    return conn.execute(stmt).first() is not None


def _ensure(conn: Connection, tenant_id: str, capture_id: str) -> None:
    if not _exists(conn, tenant_id, capture_id):
        row = {"tenant_id": tenant_id, "capture_id": capture_id, "created_at": utcnow()}
        conn.execute(insert(CAPTURES), row)


def _put_rewards(conn: Connection, values: list[dict]) -> None:
    for v in values:
        conn.execute(
            delete(REWARDS).where(
                (REWARDS.c.tenant_id == v["tenant_id"])
                & (REWARDS.c.capture_id == v["capture_id"])
                & (REWARDS.c.trajectory_id == v["trajectory_id"])
            )
        )
    if values:
        conn.execute(insert(REWARDS), values)


def _turn(r) -> Turn:
    return Turn(
        r.completion_id,
        np.frombuffer(r.prompt, dtype="<i4").tolist(),
        np.frombuffer(r.tokens, dtype="<i4").tolist(),
        np.frombuffer(r.logprobs, dtype="<f4").tolist(),
        r.sequence_id,
        r.session_id,
    )


def _public(r) -> dict:
    turn = _turn(r)
    created: dt.datetime = r.created_at
    return {
        "completion_id": r.completion_id,
        "trajectory_id": r.trajectory_id,
        "model": r.model,
        "base_model": r.base_model,
        "sampler_version": r.sampler_version,
        "sequence_id": r.sequence_id,
        "prompt_tokens": turn.prompt_T,
        "tokens": turn.tokens_T,
        "logprobs": turn.logprobs_T,
        "finish_reason": r.finish_reason,
        "created_at": created.isoformat() if created else None,
    }
