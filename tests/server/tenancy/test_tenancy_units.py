"""Tenancy pieces in-process, without a server: keys and development mode, quota
precedence, the rate window, the usage field of protobuf results, usage reports.

    .venv/bin/python -m pytest -q tests/server/tenancy/test_tenancy_units.py
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from threading import get_ident

import pytest
from sqlalchemy import event

from treadle.errors import AuthError, QuotaExceededError
from treadle.server.config import Price
from treadle.server.storage.database import Store
from treadle.server.storage.queries import insert_row
from treadle.server.storage.rows import RequestRow
from treadle.server.tenancy import auth, metering, tenants
from treadle.server.tenancy.quotas import QuotaBook, Quotas, RateLimiter
from treadle.types import SampledSequence, SampleResponse
from treadle.wire import codec


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'treadle.db'}")
    yield s
    s.close()


class Clock:
    """A fake monotonic clock: the tests move it, nobody sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def reads_of(store: Store) -> list[int]:
    """The thread of every statement run on `store` from now on."""
    threads: list[int] = []
    event.listen(store.engine, "before_cursor_execute", lambda *a: threads.append(get_ident()))
    return threads


def test_keys_are_stored_hashed_and_development_mode_ends_with_the_first_tenant(store):
    async def main() -> None:
        seen: dict[str, dict] = {}
        clock = Clock()
        ring = auth.KeyRing(store.engine, on_quotas=seen.__setitem__, ttl_s=5.0, clock=clock)
        assert ring.dev_mode and await ring.authenticate(None) == auth.DEV_TENANT
        tenants.create_tenant(store, "acme", {"max_lora_rank": 8})
        key, row = tenants.create_key(store, "acme")
        assert key.startswith("tml-") and len(key) > 40
        assert row.key_hash == auth.hash_key(key) and key not in str(tenants.list_tenants(store))
        assert await ring.authenticate(None) == auth.DEV_TENANT  # "no tenant" is kept ttl_s
        clock.now = 5.0
        with pytest.raises(AuthError, match="missing API key"):
            await ring.authenticate(None)  # the running server noticed the tenant
        tenant = await ring.authenticate(key)  # a key it never saw works at once
        assert tenant.name == "acme" and seen[tenant.tenant_id] == {"max_lora_rank": 8}
        with pytest.raises(AuthError, match="not recognised"):
            await ring.authenticate(auth.new_key())

    asyncio.run(main())


def test_a_revoked_key_works_until_the_cache_ttl_and_fails_after(store):
    tenants.create_tenant(store, "acme")
    key, _ = tenants.create_key(store, "acme")
    clock = Clock()
    ring = auth.KeyRing(store.engine, on_quotas=lambda *a: None, ttl_s=5.0, clock=clock)

    async def main() -> None:
        assert (await ring.authenticate(key)).name == "acme"  # read at t=0
        tenants.revoke_key(store, key[: auth.KEY_ID_CHARS])  # `treadle admin revoke-key`
        clock.now = 4.9
        assert (await ring.authenticate(key)).name == "acme"  # within the TTL
        clock.now = 5.0
        with pytest.raises(AuthError, match="revoked"):
            await ring.authenticate(key)
        clock.now = 60.0
        with pytest.raises(AuthError, match="revoked"):
            await ring.authenticate(key)

    asyncio.run(main())


def test_authentication_reads_no_database_on_the_event_loop(store):
    tenants.create_tenant(store, "acme")
    key, _ = tenants.create_key(store, "acme")
    clock = Clock()
    ring = auth.KeyRing(store.engine, on_quotas=lambda *a: None, ttl_s=5.0, clock=clock)
    threads = reads_of(store)

    async def main() -> None:
        loop_thread = get_ident()
        # concurrent first requests with one key share one read, in a worker thread
        got = await asyncio.gather(*(ring.authenticate(key) for _ in range(20)))
        assert {t.name for t in got} == {"acme"} and len(threads) == 1
        for _ in range(100):  # the common case: no read at all
            await ring.authenticate(key)
        assert len(threads) == 1
        clock.now = 5.0  # stale: read again, off the loop
        await ring.authenticate(key)
        with pytest.raises(AuthError):
            await ring.authenticate(auth.new_key())  # an unknown key is read, off the loop
        assert len(threads) == 3 and loop_thread not in threads

    asyncio.run(main())


def test_request_key_headers():
    assert auth.request_key([(b"x-api-key", b"tml-a")]) == "tml-a"
    assert auth.request_key([(b"authorization", b"Bearer tml-b")]) == "tml-b"
    both = [(b"authorization", b"Bearer tml-b"), (b"x-api-key", b"tml-a")]
    assert auth.request_key(both) == "tml-a"
    assert auth.request_key([(b"authorization", b"Basic abc")]) is None


def test_quota_precedence_and_clearing(store):
    defaults = Quotas(max_concurrent_sessions=8, requests_per_minute=100)
    config = defaults.overlay({"requests_per_minute": 50, "max_lora_rank": 16})
    assert (config.max_concurrent_sessions, config.requests_per_minute) == (8, 50)
    tenants.create_tenant(store, "acme", {"requests_per_minute": 10})
    row = tenants.set_quotas(store, "acme", {"max_lora_rank": 4, "requests_per_minute": None})
    assert row.quotas == {"requests_per_minute": 10, "max_lora_rank": 4}
    effective = config.overlay(row.quotas)
    assert (effective.requests_per_minute, effective.max_lora_rank) == (10, 4)
    row = tenants.set_quotas(store, "acme", {"requests_per_minute": 0})  # 0 clears
    assert config.overlay(row.quotas).requests_per_minute == 50
    with pytest.raises(ValueError):
        Quotas(max_lora_rank=0)
    # the book the server asks: config defaults, then per-tenant config, then the row
    book = QuotaBook(defaults, {"acme": Quotas(requests_per_minute=50, max_lora_rank=16)})
    book.from_db[row.tenant_id] = {"max_lora_rank": 4}
    got = book.of(row.tenant_id, "acme")
    assert (got.max_concurrent_sessions, got.requests_per_minute, got.max_lora_rank) == (8, 50, 4)
    assert book.of("someone-else", "beta").max_lora_rank is None


def test_rate_window_slides():
    rate = RateLimiter(window_s=0.3)
    for _ in range(3):
        rate.take("t", 3)
    with pytest.raises(QuotaExceededError, match=r"requests_per_minute \(3\)") as over:
        rate.take("t", 3)
    assert 0 < over.value.retry_after_s <= 0.3 and "Retry-After" in over.value.http_headers
    rate.take("other", 3)  # per tenant
    time.sleep(0.35)
    rate.take("t", 3)


def test_usage_field_is_invisible_to_protobuf_parsers():
    resp = SampleResponse(
        sequences=[SampledSequence(stop_reason="length", tokens=[1, 2, 3], logprobs=[-1.0] * 3)]
    )
    body = codec.encode_sample_response(resp)
    usage = {
        "prefill_tokens": 300,
        "sample_tokens": 3,
        "train_tokens": 2**40,
        "cached_prefill_tokens": 17,
    }
    tagged = metering.with_usage(body, "application/x-protobuf", usage)
    assert metering.proto_usage(tagged) == usage and metering.proto_usage(body) is None
    assert codec.decode_sample_response(tagged).sequences[0].tokens == [1, 2, 3]
    as_json = metering.with_usage(b'{"metrics": {}}', "application/json", usage)
    assert as_json == b'{"metrics": {}, "usage": ' + str(usage).replace("'", '"').encode() + b"}"


def test_usage_report_groups_and_prices(store):
    day1 = dt.datetime(2026, 11, 1, 12, tzinfo=dt.UTC)
    day2 = dt.datetime(2026, 11, 2, 12, tzinfo=dt.UTC)
    rows = [  # (tenant, session, model, prefill, sample, train, status, finished)
        ("a", "s1", "m1", 10, 5, 0, "done", day1),
        ("a", "s1", "m1", 0, 0, 100, "done", day1),
        ("a", "s2", "m2", 7, 3, 0, "done", day2),
        ("a", "s2", "m2", 0, 0, 0, "failed", day2),  # failed before it ran: not metered
        ("a", "s2", "m2", 4, 2, 0, "failed", day2),  # cancelled mid-generation: what ran
        ("b", "s3", "m1", 1000, 0, 0, "done", day2),
    ]
    with store.engine.begin() as conn:
        for i, (t, s, m, p, g, tr, status, when) in enumerate(rows):
            values = {
                "request_id": f"r{i}",
                "kind": "sample",
                "tenant_id": t,
                "session_id": s,
                "base_model": m,
                "prompt_tokens": p,
                "sampled_tokens": g,
                "train_tokens": tr,
                "status": status,
                "finished_at": when,
            }
            insert_row(conn, RequestRow, values)
    prices = {"m1": Price(prefill=1.0, sample=2.0, train=3.0)}
    report = metering.usage_report(store.engine, prices, tenant_id="a", by="model")
    assert [(r["key"], r["prefill_tokens"], r["train_tokens"]) for r in report["rows"]] == [
        ("m1", 10, 100),
        ("m2", 11, 0),
    ]
    assert report["total"]["cost_usd"] == pytest.approx((10 * 1 + 5 * 2 + 100 * 3) / 1e6)
    assert report["unpriced_models"] == ["m2"]
    by_day = metering.usage_report(store.engine, prices, "a", by="day")
    assert [(r["key"], r["requests"]) for r in by_day["rows"]] == [
        ("2026-11-01", 2),
        ("2026-11-02", 2),
    ]
    since = metering.parse_since("2026-11-02")
    late = metering.usage_report(store.engine, prices, "a", since=since, by="session")
    assert [r["key"] for r in late["rows"]] == ["s2"]
    everyone = metering.usage_report(store.engine, prices)
    assert {r["key"]: r["prefill_tokens"] for r in everyone["rows"]} == {"a": 21, "b": 1000}
    assert "total" in metering.format_report(everyone)
