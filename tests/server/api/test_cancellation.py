"""Cancellation, queue state and batch polling against a real server (in this process),
through the official tinker SDK and raw HTTP: cancel_future stops a generation between two
decode steps (its slot freed, metered for what it sampled) and a queued op before it runs;
a /v1 stream whose client goes away stops generating; try-again replies say
paused_capacity while the decode batch is full and paused_rate_limit while the tenant is at
its rate; samplers poll their futures together (retrieve_futures) and copies of a sampling
client join its session (join_sampling_session).

    .venv/bin/python -m pytest -q tests/server/api/test_cancellation.py
"""

from __future__ import annotations

import pickle
import sqlite3
import time

import httpx
import pytest
from _tenancy import TINY, Api, make_tenants

tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402

LONG = 900  # tokens of a generation long enough to be caught in the middle
WAIT = 120


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from _inproc import InProcessServer

    data = tmp_path_factory.mktemp("cancel")
    keys = make_tenants(data, {"alice": None, "bob": None, "carol": {"requests_per_minute": 1}})
    config = {"max_sample_batch": 1, "long_poll_s": 1.0}
    with InProcessServer({TINY: tiny_model_dir}, data, config=config) as srv:
        srv.keys = keys
        yield srv


@pytest.fixture
def alice(server):
    api = Api(server.url, server.keys["alice"])
    yield api
    api.close()


def row(server, request_id: str) -> dict:
    with sqlite3.connect(server.data_dir / "treadle.db") as db:
        db.row_factory = sqlite3.Row
        found = db.execute("SELECT * FROM requests WHERE request_id = ?", (request_id,)).fetchone()
    return dict(found) if found else {}


def last_sample(server) -> tuple:
    """The newest sample request's (status, error, sampled tokens), once it is finished."""
    found: list = []

    def finished() -> bool:
        with sqlite3.connect(server.data_dir / "treadle.db") as db:
            found[:] = db.execute(
                "SELECT status, error, sampled_tokens FROM requests WHERE kind = 'sample' "
                "ORDER BY created_at DESC LIMIT 1"
            ).fetchone()
        return found[0] != "pending"

    wait_for(finished, "the sample request to finish")
    return tuple(found)


def decode_batch(api: Api) -> int:
    status = api.get("treadle/status").json()
    return sum(r["decode_batch"] for m in status["models"] for r in m["replicas"])


def wait_for(pred, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def sampler(api: Api) -> str:
    sid = api.ok("create_session", {"tags": []})["session_id"]
    return api.ok(
        "create_sampling_session",
        {"session_id": sid, "sampling_session_seq_id": 0, "base_model": TINY},
    )["sampling_session_id"]


def asample(api: Api, sampler_id: str, seq: int, max_tokens: int) -> str:
    body = {
        "sampling_session_id": sampler_id,
        "seq_id": seq,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": max_tokens, "stop": [], "seed": seq},
    }
    return api.ok("asample", body)["request_id"]


def test_cancel_future_stops_a_generation_and_a_queued_op(server, alice):
    sid = sampler(alice)
    running = asample(alice, sid, 0, LONG)
    wait_for(lambda: decode_batch(alice) == 1, "the generation to start")
    queued = asample(alice, sid, 1, LONG)  # waits: the decode batch holds one
    # its poll says why it waits
    reply = alice.post("retrieve_future", {"request_id": queued}).json()
    assert reply["type"] == "try_again" and reply["queue_state"] == "paused_capacity", reply
    assert "decode batch" in reply["queue_state_reason"]

    bob = Api(server.url, server.keys["bob"])
    assert bob.post("cancel_future", {"request_id": running}).status_code == 404
    bob.close()
    assert alice.ok("cancel_future", {"request_id": queued}) == {
        "request_id": queued, "cancelled": True, "state": "cancelled"
    }  # fmt: skip
    got = alice.ok("cancel_future", {"request_id": running})
    assert got["cancelled"] and got["state"] == "cancelled"
    for rid in (running, queued):
        failed = alice.result(rid).json()
        assert "cancelled" in failed["error"] and failed["category"] == "user", failed
    wait_for(lambda: decode_batch(alice) == 0, "the slot to be freed")
    ran, waited = row(server, running), row(server, queued)
    assert ran["status"] == waited["status"] == "failed"
    assert ran["prompt_tokens"] == 3 and 0 < ran["sampled_tokens"] < LONG  # what ran
    assert waited["prompt_tokens"] == waited["sampled_tokens"] == 0  # nothing ran
    # the freed slot serves the next request at once
    after = asample(alice, sid, 2, 4)
    assert len(alice.result(after, proto=False).json()["sequences"][0]["tokens"]) == 4
    # a finished request is not cancelled again
    assert alice.ok("cancel_future", {"request_id": after})["state"] == "finished"


def test_the_sdk_cancels_the_sample_it_abandons(server):
    svc = tinker.ServiceClient(base_url=server.url, api_key=server.keys["alice"])
    try:
        sc = svc.create_sampling_client(base_model=TINY).result(timeout=WAIT)
        future = sc.sample(
            T.ModelInput.from_ints([5, 6, 7]), 1, T.SamplingParams(max_tokens=LONG, stop=[])
        )
        api = Api(server.url, server.keys["alice"])
        wait_for(lambda: decode_batch(api) == 1, "the generation to start")
        future.future().cancel()  # the SDK then sends cancel_future (dynamic_config says so)
        wait_for(lambda: decode_batch(api) == 0, "the generation to stop")
        status, error, sampled = last_sample(server)
        assert status == "failed" and "cancelled" in error and sampled < LONG
        api.close()
    finally:
        svc.close("success").result(timeout=30)


def test_a_stream_whose_client_goes_away_stops_generating(server, alice):
    body = {
        "model": TINY, "prompt": "hello", "max_tokens": LONG, "stream": True,
        "ignore_eos": True, "seed": 1,
    }  # fmt: skip
    headers = {"X-API-Key": server.keys["alice"]}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=WAIT
    ) as resp:
        assert resp.status_code == 200
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 3:
                break  # and the connection closes
    wait_for(lambda: decode_batch(alice) == 0, "the stream's generation to stop")
    status, error, sampled = last_sample(server)
    assert status == "failed" and "cancelled" in error and 0 < sampled < LONG


def test_try_again_says_paused_rate_limit_while_the_tenant_is_at_its_rate(server):
    carol = Api(server.url, server.keys["carol"])
    sid = sampler(carol)
    rid = asample(carol, sid, 0, LONG)  # its one request this minute
    reply = carol.post("retrieve_future", {"request_id": rid}).json()
    assert reply["type"] == "try_again" and reply["queue_state"] == "paused_rate_limit", reply
    assert "requests_per_minute" in reply["queue_state_reason"]
    carol.ok("cancel_future", {"request_id": rid})
    carol.close()


def test_samplers_poll_together_and_copies_join_their_session(server, alice):
    svc = tinker.ServiceClient(base_url=server.url, api_key=server.keys["alice"])
    try:
        sc = svc.create_sampling_client(base_model=TINY).result(timeout=WAIT)
        prompt = T.ModelInput.from_ints([5, 6, 7])
        params = T.SamplingParams(max_tokens=3, seed=1, stop=[])
        first = sc.sample(prompt, 1, params).result(timeout=WAIT)
        copies = [pickle.loads(pickle.dumps(sc)) for _ in range(2)]
        for copy in copies:  # each joined: its own clone number, its seq_ids apart
            got = copy.sample(prompt, 1, params).result(timeout=WAIT)
            assert got.sequences[0].tokens == first.sequences[0].tokens
        with sqlite3.connect(server.data_dir / "treadle.db") as db:
            clients = dict(db.execute("SELECT sampling_session_id, clients FROM sampling_sessions"))
            sid = max(clients, key=clients.get)  # the one the copies joined
            seqs = [s for (s,) in db.execute(
                "SELECT seq_id FROM requests WHERE kind = 'sample' AND sampling_session_id = ?",
                (sid,),
            )]  # fmt: skip
        assert clients[sid] == 2
        assert sorted(s // 10**9 for s in seqs) == [0, 1, 2]
    finally:
        svc.close("success").result(timeout=30)
    # the batch poll itself: completions after a cursor, and nothing of another tenant's
    sid = sampler(alice)
    rids = [asample(alice, sid, i, 2) for i in range(2)]
    for rid in rids:
        alice.result(rid)
    target = {"sampling_session_id": sid, "cloned_sampler_id": 0}
    got = alice.ok("retrieve_futures", {"target": target, "prev_cursor": 0, "timeout": 0})
    assert [c["request_id"] for c in got["completions"]] == rids
    assert all(c["state"] == "finished" for c in got["completions"])
    again = alice.ok(
        "retrieve_futures", {"target": target, "prev_cursor": got["cursor"], "timeout": 0}
    )
    assert again["completions"] == [] and again["cursor"] == got["cursor"]
    bob = Api(server.url, server.keys["bob"])
    assert bob.post("retrieve_futures", {"target": target, "timeout": 0}).status_code == 404
    assert bob.post("join_sampling_session", {"sampling_session_id": sid}).status_code == 404
    bob.close()


def test_the_treadle_sdk_cancels_a_sample(server):
    import concurrent.futures

    from treadle import SamplingParams, ServiceClient

    with ServiceClient(base_url=server.url, api_key=server.keys["alice"]) as svc:
        sc = svc.create_sampling_client(base_model=TINY)
        future = sc.sample([5, 6, 7], 1, SamplingParams(max_tokens=LONG, stop=[]))
        api = Api(server.url, server.keys["alice"])
        wait_for(lambda: decode_batch(api) == 1, "the generation to start")
        assert future.cancel()
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(WAIT)
        wait_for(lambda: decode_batch(api) == 0, "the generation to stop")
        status, error, sampled = last_sample(server)
        assert status == "failed" and "cancelled" in error and sampled < LONG
        done = sc.sample([5, 6, 7], 1, SamplingParams(max_tokens=2, stop=[]))
        done.result(WAIT)
        assert not done.cancel()  # finished: nothing to stop
        api.close()
