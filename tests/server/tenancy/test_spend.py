"""Spend caps and spend counting without HTTP or an engine (a real database and journal,
fake ops): periods, counting and the 429 naming the cap, the baseline read at start-up, and
the spend listener, which charges every finished op to its tenant and key from the op's own
request (never from a map that lets ops go), with the console off and on.

    .venv/bin/python -m pytest -q tests/server/tenancy/test_spend.py
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import numpy as np
import pytest
from sqlalchemy import select

from treadle.engine.types import AdamSpec, SampledSeq, SampleRequest, SampleResult, TrainDatum
from treadle.errors import QuotaExceededError
from treadle.protocol.facts import EngineFacts
from treadle.protocol.ops import Op, OpKind, OptimStep, Outcome, Sample, TrainData, Usage
from treadle.server.config import InputLimits, Price
from treadle.server.console import recorder as console_recorder
from treadle.server.core.board import FutureBoard
from treadle.server.core.futures import Futures
from treadle.server.core.limits import Admission
from treadle.server.storage.database import Store
from treadle.server.storage.journal import Journal
from treadle.server.storage.rows import OpRecordRow, RequestRow, utcnow
from treadle.server.tenancy import auth, spend, tenants
from treadle.server.tenancy.auth import Tenant
from treadle.server.tenancy.quotas import QuotaBook, Quotas
from treadle.server.tenancy.spend_listener import SpendListener

PRICE = {"m": Price(prefill=1.0, sample=2.0, train=4.0)}  # $ per million tokens


class Engine:
    """Records queued ops; the test finishes them by hand."""

    facts = EngineFacts("m", vocab_size=10, max_seq_len=64, max_lora_rank=8)
    name = "m"

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def submit(self, op: Op) -> None:
        self.ops.append(op)


def datum(n: int, weighted: int) -> TrainDatum:
    w = np.zeros(n, np.float32)
    w[:weighted] = 1.0
    return TrainDatum(np.arange(n), {"target_tokens": np.arange(n), "weights": w})


def run(tmp_path, scenario, console: bool = False) -> None:
    """`scenario(store, futures, book, engine)` with the listeners the app gives Futures:
    the spend listener, and the console's recorder when `console`."""

    async def main() -> None:
        store = Store(f"sqlite:///{tmp_path / 'treadle.db'}")
        journal = Journal(store.engine)
        journal.start()
        book = spend.SpendBook(store.engine, PRICE)
        listener = SpendListener(book)
        await asyncio.to_thread(listener.load)
        listeners = [listener]
        recorder = console_recorder.Recorder(journal) if console else None
        if recorder is not None:
            listeners.append(recorder)
        admission = Admission(InputLimits(), QuotaBook(Quotas(), {}), spend=book)
        board = FutureBoard(asyncio.get_running_loop())
        futures = Futures(journal, board, admission, 30.0, listeners)
        try:
            await scenario(store, futures, book, Engine())
            if recorder is not None:
                await asyncio.to_thread(recorder.flush)
        finally:
            journal.stop()
            store.close()

    asyncio.run(main())


def test_periods():
    when = dt.datetime(2026, 12, 31, 23, 59, tzinfo=dt.UTC)
    assert spend.period_bounds("day", when) == (
        dt.datetime(2026, 12, 31, tzinfo=dt.UTC),
        dt.datetime(2027, 1, 1, tzinfo=dt.UTC),
    )
    assert spend.period_bounds("month", when) == (
        dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
        dt.datetime(2027, 1, 1, tzinfo=dt.UTC),
    )
    assert spend.period_bounds("month", when.replace(month=2, day=3))[1].month == 3


def test_spend_caps_count_and_refuse_with_a_message_naming_the_cap(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'treadle.db'}")
    try:
        tenants.create_tenant(store, "acme")
        key, key_row = tenants.create_key(store, "acme")
        acme = Tenant(tenants.find_tenant(store, "acme").tenant_id, "acme")
        # a request finished before the server started counts towards today's cap
        store.add(
            RequestRow(
                request_id="old",
                kind="forward_backward",
                tenant_id=acme.tenant_id,
                base_model="m",
                status="done",
                train_tokens=60,
                finished_at=utcnow(),
            )
        )
        book = spend.SpendBook(store.engine, PRICE)
        book.load()
        book.check(acme, None)  # no caps yet
        assert spend.set_cap(store, "acme", "day", max_tokens=100)["max_tokens"] == 100
        spend.set_cap(store, "acme", "month", max_usd=0.001, key=key_row.key_id)
        book._caps_read_at = float("-inf")  # re-read at once, not within a second
        book.check(acme, key_row.key_id)  # 60 of 100 tokens; the key spent $0 of $0.001
        book.add(acme.tenant_id, key_row.key_id, "m", (10, 20, 10), time.time())
        with pytest.raises(QuotaExceededError) as err:
            book.check(acme, None)
        message = str(err.value)
        assert message.startswith("spend cap tokens_per_day (100 tokens) of tenant 'acme'")
        assert "100 tokens spent" in message and "resets at" in message
        assert err.value.http_headers == {"x-should-retry": "false"}
        # the key's own cap: 40 of its tokens cost 10*1 + 20*2 + 10*4 = $0.00009
        spend.set_cap(store, "acme", "day", max_tokens=0)  # cleared
        book._caps_read_at = float("-inf")
        book.check(acme, key_row.key_id)
        book.add(acme.tenant_id, key_row.key_id, "m", (0, 500, 0), time.time())
        with pytest.raises(QuotaExceededError, match=r"usd_per_month \(\$0.001\) of key tml-"):
            book.check(acme, key_row.key_id)
        book.check(acme, None)  # another key of the tenant is not capped
        # a result of yesterday finishing late changes nothing of today
        book.add(acme.tenant_id, None, "m", (0, 0, 10**6), time.time() - 2 * 86400)
        assert book.spent(acme.tenant_id, spend.TENANT_SCOPE, "day").tokens == 600
        report = book.report(acme.tenant_id)
        assert [(c["scope"], c["period"], c["max_usd"]) for c in report] == [
            (spend.key_scope(key_row.key_id), "month", 0.001)
        ]
        with pytest.raises(ValueError, match="tokens or usd"):
            spend.set_cap(store, "acme", "day")
        with pytest.raises(ValueError, match="period"):
            spend.set_cap(store, "acme", "week", max_tokens=5)
    finally:
        store.close()


def test_only_metered_operations_meet_a_spend_cap(tmp_path):
    async def scenario(store, futures, book, engine):
        tenants.create_tenant(store, "acme")
        acme = Tenant(tenants.find_tenant(store, "acme").tenant_id, "acme")
        spend.set_cap(store, "acme", "day", max_tokens=1)
        book.add(acme.tenant_id, None, "m", (0, 0, 5), time.time())
        kw = {"tenant": acme, "session_id": "s", "model_id": "s:train:0"}
        with pytest.raises(QuotaExceededError, match="spend cap"):
            await futures.file(
                engine,
                OpKind.FORWARD_BACKWARD,
                TrainData([datum(4, 4)], "cross_entropy", {}),
                seq_id=1,
                **kw,
            )
        # the refused forward_backward held its seq_id with a skip; an optimizer step passes
        assert [op.kind for op in engine.ops] == [OpKind.SKIP]
        await futures.file(engine, OpKind.OPTIM_STEP, OptimStep(AdamSpec()), seq_id=2, **kw)
        assert engine.ops[-1].kind == OpKind.OPTIM_STEP

    run(tmp_path, scenario)


# ---- the spend listener ----
N_OPS, BOUND = 40, 8  # ops in flight at once; what the console's map may keep (lowered)


async def file_samples(futures, engine, who: list[tuple[Tenant, str | None]]) -> list[str]:
    """One sample op per (tenant, key id), filed as its key's request would be."""
    rids = []
    for tenant, kid in who:
        token = auth.set_current_key_id(kid)  # what KeyIdMiddleware sets for a request
        try:
            kw = {"tenant": tenant, "session_id": tenant.name, "sampling_session_id": "x"}
            req = SampleRequest([1, 2, 3], num_samples=1)
            rids.append(await futures.file(engine, OpKind.SAMPLE, Sample(req), **kw))
        finally:
            auth.reset_current_key_id(token)
    return rids


def usage_of(i: int) -> Usage:
    return Usage(prompt_tokens=3 + i, sampled_tokens=1 + i % 5, train_tokens=0)


@pytest.mark.parametrize("console", [False, True], ids=["console-off", "console-on"])
def test_every_op_is_charged_past_every_in_memory_bound(tmp_path, monkeypatch, console):
    monkeypatch.setattr(console_recorder, "MAX_PENDING", BOUND)
    acme, beta = Tenant("t-acme", "acme"), Tenant("t-beta", "beta")
    who = [(acme, "tml-keyA"), (acme, "tml-keyB"), (beta, None), (beta, "tml-keyC")]
    who = [who[i % len(who)] for i in range(N_OPS)]

    async def scenario(store, futures, book, engine):
        rids = await file_samples(futures, engine, who)  # all in flight at once
        assert len(engine.ops) == N_OPS
        result = SampleResult([SampledSeq([1], [0.0], "length")])
        outcomes = [Outcome.ok(r, result, usage_of(i)) for i, r in enumerate(rids)]
        for chunk in (outcomes[:15], outcomes[15:]):  # two rounds of results
            futures.finish([o.timed(time.time()) for o in chunk])
        for r in rids:
            await futures.result(r)
        await futures.journal.run(lambda conn: None)  # every listener has heard
        # the independent sums: each op's usage, by its tenant and by its key
        want: dict[tuple[str, str], list[int]] = {}
        for (tenant, kid), o in zip(who, outcomes, strict=True):
            u = o.usage
            scopes = [spend.TENANT_SCOPE] + ([spend.key_scope(kid)] if kid else [])
            for scope in scopes:
                slot = want.setdefault((tenant.tenant_id, scope), [0, 0])
                slot[0] += u.prompt_tokens + u.sampled_tokens
                slot[1] += u.prompt_tokens * 1 + u.sampled_tokens * 2  # $ per M, PRICE
        for (tid, scope), (tokens, micro_usd) in want.items():
            for period in spend.PERIODS:
                got = book.spent(tid, scope, period)
                assert got.tokens == tokens, (tid, scope, period)
                assert got.usd == pytest.approx(micro_usd * 1e-6)
        # the request rows keep whom each op is charged to: a restart's baseline agrees
        rows = store.query(select(RequestRow))
        assert {(r.tenant_id, r.key_id) for r in rows} == {(t.tenant_id, k) for t, k in who}
        fresh = spend.SpendBook(store.engine, PRICE)
        fresh.load()
        for (tid, scope), (tokens, _) in want.items():
            assert fresh.spent(tid, scope, "day").tokens == tokens
        # the console (when on) let ops go past its bound; spend did not
        assert len(futures.listeners[0]) == 0  # and holds nothing once they finished

    run(tmp_path, scenario, console=console)
    if console:
        store = Store(f"sqlite:///{tmp_path / 'treadle.db'}")
        try:
            assert 0 < len(store.query(select(OpRecordRow))) <= BOUND < N_OPS
        finally:
            store.close()


def test_ops_a_previous_run_left_unfinished_are_charged_when_they_finish(tmp_path):
    acme = Tenant("t-acme", "acme")
    rids: list[str] = []

    async def before(store, futures, book, engine):  # the first run files, then dies
        rids.extend(await file_samples(futures, engine, [(acme, "tml-keyA")] * 3))

    async def after(store, futures, book, engine):  # the next run finishes them
        assert book.spent(acme.tenant_id, spend.TENANT_SCOPE, "day").tokens == 0
        for r in rids:
            futures.expect(r, OpKind.SAMPLE, acme.tenant_id)  # as recovery does
        result = SampleResult([SampledSeq([1], [0.0], "length")])
        usage = Usage(prompt_tokens=5, sampled_tokens=2)
        futures.finish([Outcome.ok(r, result, usage).timed(time.time()) for r in rids])
        futures.finish([Outcome.ok(rids[0], result, usage).timed(time.time())])  # again
        for r in rids:
            await futures.result(r)
        await futures.journal.run(lambda conn: None)
        for scope in (spend.TENANT_SCOPE, spend.key_scope("tml-keyA")):
            assert book.spent(acme.tenant_id, scope, "month").tokens == 3 * 7  # once each

    run(tmp_path, before)
    run(tmp_path, after)
