"""Checkpoints between tenants and over time, against a real server (in this process):
publication (another tenant samples from and loads a published checkpoint, and only while
it is published), copy_weights (a copy of one's own in a new run, files shared, untrainable,
outliving its source), and checkpoint search (filters and cursor paging, newest first,
through the route and the treadle SDK).

    .venv/bin/python -m pytest -q tests/server/api/test_checkpoint_sharing.py
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from _tenancy import TINY, Api, make_tenants

from treadle import ServiceClient as TreadleService

tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402

WAIT = 120
PROMPT = T.ModelInput.from_ints([5, 6, 7, 8, 9])


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from _inproc import InProcessServer

    data = tmp_path_factory.mktemp("sharing")
    keys = make_tenants(data, {"alice": None, "bob": None})
    with InProcessServer({TINY: tiny_model_dir}, data) as srv:
        srv.keys = keys
        yield srv


def service(server, who: str, **kw):
    return tinker.ServiceClient(base_url=server.url, api_key=server.keys[who], **kw)


def rest(server, who: str):
    return tinker.RestClient(base_url=server.url, api_key=server.keys[who])


def trained_sampler(svc, name: str) -> tuple[str, list]:
    """A checkpoint whose weights differ from the base's; → its path and its logprobs."""
    tc = svc.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    datum = T.Datum(
        model_input=T.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
    )
    tc.forward_backward([datum], "cross_entropy").result(timeout=WAIT)
    tc.optim_step(T.AdamParams(learning_rate=0.05)).result(timeout=WAIT)
    path = tc.save_weights_for_sampler(name).result(timeout=WAIT).path
    own = svc.create_sampling_client(model_path=path).result()
    return path, own.compute_logprobs(PROMPT).result(timeout=WAIT)


def test_a_published_checkpoint_is_readable_by_every_tenant_while_published(server):
    alice, bob = service(server, "alice"), service(server, "bob")
    try:
        path, want = trained_sampler(alice, "shared")
        with pytest.raises(tinker.NotFoundError):
            bob.create_sampling_client(model_path=path).result()
        rest(server, "alice").publish_checkpoint_from_tinker_path(path).result(timeout=WAIT)
        got = bob.create_sampling_client(model_path=path).result()
        assert got.compute_logprobs(PROMPT).result(timeout=WAIT) == pytest.approx(want, abs=1e-5)
        loaded = bob.create_training_client_from_state(path).result()  # weights into a run
        assert loaded.get_info().model_data.model_name == TINY
        listed = rest(server, "alice").list_user_checkpoints().result(timeout=WAIT).checkpoints
        assert next(c for c in listed if c.tinker_path == path).public
        # only its owner lists, publishes, deletes or sets its TTL
        with pytest.raises(tinker.NotFoundError):
            rest(server, "bob").unpublish_checkpoint_from_tinker_path(path).result(timeout=WAIT)
        with pytest.raises(tinker.NotFoundError):
            rest(server, "bob").delete_checkpoint_from_tinker_path(path).result(timeout=WAIT)
        theirs = rest(server, "bob").list_user_checkpoints().result(timeout=WAIT).checkpoints
        assert path not in {c.tinker_path for c in theirs}
        rest(server, "alice").unpublish_checkpoint_from_tinker_path(path).result(timeout=WAIT)
        with pytest.raises(tinker.NotFoundError):
            bob.create_sampling_client(model_path=path).result()
    finally:
        for s in (alice, bob):
            s.close("success").result(timeout=30)


def test_copy_weights_makes_a_copy_of_ones_own_that_outlives_its_source(server):
    alice, bob = service(server, "alice"), service(server, "bob", project_id="archive")
    try:
        path, want = trained_sampler(alice, "to-copy")
        alice_rest = rest(server, "alice")
        own_copy = alice_rest.copy_weights(path, "backups", ttl_seconds=7200).result(timeout=WAIT)
        assert own_copy != path and own_copy.endswith("/sampler_weights/to-copy")
        with pytest.raises(tinker.NotFoundError):  # not published: not bob's to copy
            bob.copy_weights(path).result(timeout=WAIT)
        alice_rest.publish_checkpoint_from_tinker_path(path).result(timeout=WAIT)
        copy = bob.copy_weights(path).result(timeout=WAIT)  # into bob's project "archive"
        with sqlite3.connect(server.data_dir / "treadle.db") as db:
            (src_dir,) = db.execute("SELECT dir FROM checkpoints WHERE tinker_path=?", (path,))
            (dst_dir,) = db.execute("SELECT dir FROM checkpoints WHERE tinker_path=?", (copy,))
        weights = "adapter_model.safetensors"
        src, dst = Path(src_dir[0]) / weights, Path(dst_dir[0]) / weights
        assert os.stat(src).st_ino == os.stat(dst).st_ino  # shared, not duplicated
        alice_rest.delete_checkpoint_from_tinker_path(path).result(timeout=WAIT)
        assert not src.exists() and dst.is_file()
        sampled = bob.create_sampling_client(model_path=copy).result()
        assert sampled.compute_logprobs(PROMPT).result(timeout=WAIT) == pytest.approx(
            want, abs=1e-5
        )
        run = rest(server, "bob").get_training_run_by_tinker_path(copy).result(timeout=WAIT)
        bob_api = Api(server.url, server.keys["bob"])
        body = {"model_id": f"{run.training_run_id}:copy", "seq_id": 1}
        refused = bob_api.post("optim_step", body)  # a copy holds weights: it is not trained
        assert refused.status_code == 404 and "copy_weights" in refused.text, refused.text
        usage = bob_api.get("billing/usage/checkpoints/current").json()["data"]
        assert [u["project_id"] for u in usage] == ["archive"]
        bob_api.close()
    finally:
        for s in (alice, bob):
            s.close("success").result(timeout=30)


def test_checkpoint_search_filters_and_pages(server):
    svc = service(server, "alice", project_id="search-proj")
    other = service(server, "bob", project_id="search-proj")
    try:
        tc = svc.create_lora_training_client(base_model=TINY, rank=2).result()
        made = []
        for i in range(5):
            meta = {"task": "math" if i % 2 == 0 else "code", "i": str(i)}
            kind = tc.save_state if i < 3 else tc.save_weights_for_sampler
            made.append(kind(f"s{i}", user_metadata=meta).result(timeout=WAIT).path)
        other.create_lora_training_client(base_model=TINY, rank=2).result().save_state(
            "not-alices", user_metadata={"task": "math"}
        ).result(timeout=WAIT)
        api = Api(server.url, server.keys["alice"])

        def search(**q) -> list[str]:
            found, cursor = [], None
            while True:
                body = {**q, "limit": 2, **({"cursor": cursor} if cursor else {})}
                page = api.ok("checkpoints/search", body)
                assert len(page["checkpoints"]) <= 2
                found += [c["tinker_path"] for c in page["checkpoints"]]
                cursor = page["next_cursor"]
                if cursor is None:
                    return found

        newest_first = list(reversed(made))
        assert search(project_id="search-proj") == newest_first
        assert search(user_metadata={"task": "math"}) == [made[4], made[2], made[0]]
        here = {"project_id": "search-proj"}  # earlier tests' checkpoints are elsewhere
        assert search(checkpoint_type="sampler", **here) == [made[4], made[3]]
        assert search(checkpoint_type="training", user_metadata={"task": "code"}) == [made[1]]
        assert search(project_id="elsewhere") == []
        assert search(base_model=TINY, training_run_id="nope") == []
        # the treadle SDK pages through the same route
        sdk = TreadleService(base_url=server.url, api_key=server.keys["alice"])
        got = [c.tinker_path for c in sdk.saved.search(user_metadata={"task": "math"}, limit=1)]
        assert got == [made[4], made[2], made[0]]
        sdk.saved.set_ttl(made[0], 3600)
        first = next(sdk.saved.search(training_run_id=made[0].split("/")[2], limit=50))
        assert first.expires_at is None  # made[4], the newest, has no TTL
        sdk.close()
        bad = api.post("checkpoints/search", {"limit": 0})
        assert bad.status_code == 400 and "limit" in bad.text
        api.close()
    finally:
        for s in (svc, other):
            s.close("success").result(timeout=30)


def test_session_search_filters_and_pages(server):
    api = Api(server.url, server.keys["alice"])
    made = []
    for name in ("Nightly run A", "nightly run b", "other"):
        sid = api.ok("create_session", {"tags": [], "display_name": name})["session_id"]
        made.append(sid)
    api.ok(f"sessions/{made[1]}/finish", {"reason": {"type": "success"}})
    put = api.http.put(f"/api/v1/sessions/{made[0]}/project", json={"project_id": "night"})
    assert put.status_code == 200

    def search(**q) -> list[str]:
        found, cursor = [], None
        while True:
            body = {**q, "limit": 1, **({"cursor": cursor} if cursor else {})}
            page = api.ok("sessions/search", body)
            found += [s["session_id"] for s in page["sessions"]]
            if (cursor := page["next_cursor"]) is None:
                return [s for s in found if s in made]

    assert search(display_name="NIGHTLY run") == [made[1], made[0]]  # newest first
    assert search(display_name="nightly", statuses=[{"type": "active"}]) == [made[0]]
    assert search(statuses=[{"type": "client_finished"}]) == [made[1]]
    assert search(project_ids=["night"]) == [made[0]]
    assert search(session_id=made[2]) == [made[2]]
    assert search(owner={"type": "user", "owner_urns": ["treadle:tenant:nobody"]}) == []
    bob = Api(server.url, server.keys["bob"])
    assert not set(made) & {
        s["session_id"] for s in bob.ok("sessions/search", {"limit": 200})["sessions"]
    }
    assert (
        bob.http.put(f"/api/v1/sessions/{made[2]}/project", json={"project_id": "x"}).status_code
        == 404
    )
    bob.close()
    api.close()
