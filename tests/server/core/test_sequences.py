"""Sampled sequences kept for provenance, against a real database and journal: kept with the
sample's result, read back only by their tenant, accepted from their session only, expired
after their retention unless a training request renewed it, and purged a while later."""

from __future__ import annotations

import asyncio
import datetime as dt

import numpy as np
import pytest
from sqlalchemy import select, update

from treadle.engine.types import TrainDatum
from treadle.errors import InvalidRequestError
from treadle.protocol.ops import SequenceRecord, TrainData
from treadle.server.core import sequences
from treadle.server.storage.database import Store
from treadle.server.storage.journal import Journal
from treadle.server.storage.rows import SampledSequenceRow, utcnow
from treadle.wire.codec import Span

PROMPT, SAMPLED, LOGPROBS = [5, 6, 7], [8, 9], [-0.5, -1.25]


@pytest.fixture
def store(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    yield store
    store.close()


def keep(store: Store, sequence_id: str, tenant: str = "t1", session: str = "s1") -> None:
    record = SequenceRecord(sequence_id, tenant, session, PROMPT, SAMPLED, LOGPROBS)
    with store.engine.begin() as conn:
        sequences.insert_records(conn, [record])


def payload() -> tuple[TrainData, list]:
    """prompt + sampled tokens, shifted: targets are prompt[1:] + sampled."""
    tokens = np.array(PROMPT + SAMPLED[:-1])
    inputs = {
        "target_tokens": np.array(PROMPT[1:] + SAMPLED),
        "advantages": np.array([0, 0, 1, 1], np.float32),
    }
    spans = (
        [Span(False, "r:0", 0, 3), Span(True, "r:0", 0, 1)],
        [Span(False, "r:0", 1, 2), Span(True, "r:0", 0, 2)],
    )
    return TrainData([TrainDatum(tokens, inputs)], "stable_reinforce", {}), [spans]


def attach(store: Store, tenant: str = "t1", session: str = "s1") -> TrainData:
    async def go() -> TrainData:
        journal = Journal(store.engine)
        journal.start()
        try:
            data, spans = payload()
            await sequences.attach(journal, data, spans, tenant, session)
            return data
        finally:
            journal.stop()

    return asyncio.run(go())


def expires_at(store: Store, sequence_id: str) -> dt.datetime:
    with store.engine.connect() as conn:
        row = conn.execute(
            select(SampledSequenceRow.expires_at).where(
                SampledSequenceRow.sequence_id == sequence_id
            )
        ).scalar_one()
    return row.replace(tzinfo=dt.UTC) if row.tzinfo is None else row


def set_expiry(store: Store, sequence_id: str, when: dt.datetime) -> None:
    with store.engine.begin() as conn:
        conn.execute(
            update(SampledSequenceRow)
            .where(SampledSequenceRow.sequence_id == sequence_id)
            .values(expires_at=when)
        )


def test_provenance_becomes_the_recorded_inputs(store):
    keep(store, "r:0")
    data = attach(store)
    inputs = data.data[0].loss_inputs
    np.testing.assert_array_equal(inputs["recorded_mask"], [0, 0, 1, 1])
    np.testing.assert_array_equal(inputs["recorded_logprobs"], [0, 0, -0.5, -1.25])


def test_only_the_tenant_and_session_that_sampled_it(store):
    keep(store, "r:0")
    with pytest.raises(InvalidRequestError, match="was sampled by another session"):
        attach(store, session="s2")
    # another tenant's sequence is unknown to it, not "another session's"
    with pytest.raises(InvalidRequestError, match="is not a sequence this server recorded"):
        attach(store, tenant="t2", session="s1")


def test_expiry_renewal_and_purge(store):
    keep(store, "r:0")
    day = dt.timedelta(seconds=sequences.RETENTION_S)
    assert abs(expires_at(store, "r:0") - (utcnow() + day)) < dt.timedelta(minutes=1)
    # a training request an hour before expiry renews it for a day from now
    set_expiry(store, "r:0", utcnow() + dt.timedelta(hours=1))
    attach(store)
    assert expires_at(store, "r:0") - utcnow() > day - dt.timedelta(minutes=1)
    # past its retention it is refused as expired, naming the field
    set_expiry(store, "r:0", utcnow() - dt.timedelta(seconds=1))
    with pytest.raises(
        InvalidRequestError, match=r"data\[0\]\.loss_fn_input_spans\[0\]\.sequence_id: .* expired"
    ):
        attach(store)
    # rows expired more than PURGE_AFTER_S ago go with the next recorded sample
    set_expiry(store, "r:0", utcnow() - dt.timedelta(seconds=sequences.PURGE_AFTER_S + 60))
    keep(store, "r:1")
    with pytest.raises(InvalidRequestError, match="is not a sequence this server recorded"):
        attach(store)
