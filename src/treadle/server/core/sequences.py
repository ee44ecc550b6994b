"""Sampled sequences kept for provenance, and the check of a training request's provenance.

A sample request made with record_stability_info keeps every sequence it returns (its
prompt, its tokens and the sampler's logprob of each) under the sequence_id its submit reply
listed, written in the same transaction as the request's result (`insert_records`, called by
treadle.server.core.futures): a client learns a sequence_id only once it is kept.

A training request whose loss needs provenance (stable_reinforce, see
treadle.engine.specs.LossSpec.provenance) names those sequences in each datum's spans;
`attach` checks them at the edge, before the op is filed, and turns them into the engine's
inputs (specs.RECORDED: the sampler's logprob of each sampled target and a 0/1 mask). Every
refusal is a 400 naming the datum and span:

- a datum without loss_fn_input_spans, or spans that do not tile target_tokens
  (model_input_spans, when sent, must tile model_input);
- a sequence_id this tenant never recorded, one recorded by another session (provenance
  works only within the session that sampled it) or one past its retention;
- a span outside its sequence, or one whose tokens are not the tokens it names.

Retention: RETENTION_S after sampling, renewed by every training request that uses the
sequence. Rows are deleted PURGE_AFTER_S after they expired; until then an expired id is
named as expired rather than unknown. Another tenant's sequences are never read: their ids
are unknown here.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
from dataclasses import dataclass

import numpy as np
from sqlalchemy import Connection, delete, insert, select, update

from treadle.engine.specs import LOSS_SPECS, check_recorded
from treadle.errors import InvalidRequestError
from treadle.protocol.ops import SequenceRecord, TrainData
from treadle.server.storage.journal import Journal
from treadle.server.storage.rows import SampledSequenceRow, utcnow
from treadle.wire.codec import Span

RETENTION_S = 86400.0
PURGE_AFTER_S = 86400.0
# Datums whose provenance is checked on the event loop; more go to a worker thread.
INLINE_DATUMS = 64

SEQUENCES = SampledSequenceRow.__table__

# (model_input_spans, loss_fn_input_spans) of one datum, as decoded
Provenance = tuple[list[Span] | None, list[Span] | None]


@dataclass
class Kept:
    """A recorded sequence, as read back."""

    session_id: str
    prompt: np.ndarray  # (P,) int32
    tokens: np.ndarray  # (S,) int32
    logprobs: np.ndarray  # (S,) float32
    expires_at: dt.datetime


# ---- recording (the journal thread, with the sample's result) ----
def insert_records(conn: Connection, records: list[SequenceRecord]) -> None:
    """Keep sampled sequences; also delete the rows expired more than PURGE_AFTER_S ago."""
    now = utcnow()
    expires = now + dt.timedelta(seconds=RETENTION_S)
    rows = [
        {
            "sequence_id": r.sequence_id,
            "tenant_id": r.tenant_id,
            "session_id": r.session_id,
            "prompt": np.asarray(r.prompt, dtype="<i4").tobytes(),
            "tokens": np.asarray(r.tokens, dtype="<i4").tobytes(),
            "logprobs": np.asarray(r.logprobs, dtype="<f4").tobytes(),
            "created_at": now,
            "expires_at": expires,
        }
        for r in records
    ]
    conn.execute(insert(SEQUENCES), rows)
    stale = now - dt.timedelta(seconds=PURGE_AFTER_S)
    conn.execute(delete(SEQUENCES).where(SEQUENCES.c.expires_at < stale))


def read_sequences(conn: Connection, ids: list[str], tenant_id: str) -> dict[str, Kept]:
    """The tenant's recorded sequences among `ids` (other tenants' are not read)."""
    found: dict[str, Kept] = {}
    for start in range(0, len(ids), 500):  # within SQLite's bound-parameter limit
        chunk = ids[start : start + 500]
        stmt = select(SEQUENCES).where(
            SEQUENCES.c.sequence_id.in_(chunk) & (SEQUENCES.c.tenant_id == tenant_id)
        )
        for row in conn.execute(stmt):
            found[row.sequence_id] = Kept(
                row.session_id,
                np.frombuffer(row.prompt, dtype="<i4"),
                np.frombuffer(row.tokens, dtype="<i4"),
                np.frombuffer(row.logprobs, dtype="<f4"),
                _aware(row.expires_at),
            )
    return found


def renew(conn: Connection, ids: list[str], tenant_id: str) -> None:
    """A training request used these sequences: they are kept RETENTION_S from now."""
    expires = utcnow() + dt.timedelta(seconds=RETENTION_S)
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        conn.execute(
            update(SEQUENCES)
            .where(SEQUENCES.c.sequence_id.in_(chunk) & (SEQUENCES.c.tenant_id == tenant_id))
            .values(expires_at=expires)
        )


# ---- a training request's provenance (the edge) ----
def needs_provenance(loss_fn: str) -> bool:
    spec = LOSS_SPECS.get(loss_fn)  # an uploaded loss ("custom") takes none
    return spec is not None and spec.provenance


async def attach(
    journal: Journal,
    payload: TrainData,
    provenance: list[Provenance],
    tenant_id: str,
    session_id: str,
) -> None:
    """Check the provenance of every datum of a provenance loss and add the RECORDED
    inputs it names; renew the sequences used. Raises InvalidRequestError naming the field."""
    for i, (_, spans) in enumerate(provenance):
        if spans is None:
            raise InvalidRequestError(
                f"data[{i}].loss_fn_input_spans: {payload.loss_fn} needs provenance on every "
                "datum: sample with record_stability_info=True and name each target's sampled "
                "sequence (Datum.with_provenance, with the sequence_id of each sample)"
            )
    ids = sorted({s.sequence_id for pair in provenance for spans in pair for s in spans or ()})
    kept = await journal.run(functools.partial(read_sequences, ids=ids, tenant_id=tenant_id))
    if len(payload.data) <= INLINE_DATUMS:
        resolve(payload, provenance, kept, session_id, utcnow())
    else:  # a big batch's checks would hold up the event loop
        await asyncio.to_thread(resolve, payload, provenance, kept, session_id, utcnow())
    await journal.run(functools.partial(renew, ids=ids, tenant_id=tenant_id))


def resolve(
    payload: TrainData,
    provenance: list[Provenance],
    kept: dict[str, Kept],
    session_id: str,
    now: dt.datetime,
) -> None:
    """The checks of `attach` on sequences already read; adds the RECORDED inputs."""
    for i, (datum, (input_spans, target_spans)) in enumerate(
        zip(payload.data, provenance, strict=True)
    ):
        where = f"data[{i}]."
        T = len(datum.tokens)
        targets = np.asarray(datum.loss_inputs["target_tokens"]).reshape(-1)
        recorded = np.zeros(T, dtype=np.float32)  # (T,)
        mask = np.zeros(T, dtype=np.float32)  # (T,)
        for pos, span, seq in _walk(
            target_spans, targets, "loss_fn_inputs['target_tokens']", where, kept, session_id, now
        ):
            if span.sampled:
                stop = pos + span.length
                lp = seq.logprobs[span.offset : span.offset + span.length]
                recorded[pos:stop] = np.minimum(lp, 0.0)  # a rounding above 0 is a certainty
                mask[pos:stop] = 1.0
        if input_spans is not None:
            _walk(
                input_spans, np.asarray(datum.tokens), "model_input", where, kept, session_id, now
            )
        datum.loss_inputs["recorded_logprobs"] = recorded
        datum.loss_inputs["recorded_mask"] = mask
        check_recorded(datum, payload.loss_fn, where)


def _walk(
    spans: list[Span],
    values: np.ndarray,
    field: str,
    where: str,
    kept: dict[str, Kept],
    session_id: str,
    now: dt.datetime,
) -> list[tuple[int, Span, Kept]]:
    """Check that `spans` tile `values` and that each names tokens of a sequence this session
    recorded; → (position, span, sequence) of each run."""
    name = f"{where}{'model_input_spans' if field == 'model_input' else 'loss_fn_input_spans'}"
    total = sum(s.length for s in spans)
    if total != len(values):
        raise InvalidRequestError(
            f"{name}: the spans cover {total} positions but {where}{field} has {len(values)}; "
            "the runs must tile it exactly"
        )
    out, pos = [], 0
    for j, span in enumerate(spans):
        seq = _sequence(kept, span.sequence_id, f"{name}[{j}].sequence_id", session_id, now)
        source = seq.tokens if span.sampled else seq.prompt
        what = "sampled tokens" if span.sampled else "prompt"
        if span.offset + span.length > len(source):
            raise InvalidRequestError(
                f"{name}[{j}]: positions [{span.offset}, {span.offset + span.length}) are "
                f"outside the {len(source)}-token {what} of sequence {span.sequence_id!r}"
            )
        named = source[span.offset : span.offset + span.length]
        given = values[pos : pos + span.length]
        differs = np.flatnonzero(given != named)
        if differs.size:
            k = int(differs[0])
            raise InvalidRequestError(
                f"{where}{field}[{pos + k}] is token {int(given[k])}, but {name}[{j}] names "
                f"token {int(named[k])} ({what} position {span.offset + k} of sequence "
                f"{span.sequence_id!r})"
            )
        out.append((pos, span, seq))
        pos += span.length
    return out


def _sequence(
    kept: dict[str, Kept], sequence_id: str, name: str, session_id: str, now: dt.datetime
) -> Kept:
    seq = kept.get(sequence_id)
    if seq is None:
        raise InvalidRequestError(
            f"{name}: {sequence_id!r} is not a sequence this server recorded for you; "
            "provenance names sequences sampled with record_stability_info=True, in the "
            "training request's own session"
        )
    if seq.session_id != session_id:
        raise InvalidRequestError(
            f"{name}: {sequence_id!r} was sampled by another session; provenance is accepted "
            "only from the session that sampled it (sample and train in the same session)"
        )
    if seq.expires_at < now:
        raise InvalidRequestError(
            f"{name}: {sequence_id!r} expired at {seq.expires_at.isoformat()} (a sampled "
            f"sequence is kept {RETENTION_S / 3600:g} h after sampling or after the last "
            "training request that used it)"
        )
    return seq


def _aware(value: dt.datetime) -> dt.datetime:
    # SQLite hands back naive datetimes; every time stored here is UTC
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
