"""Per-tenant quotas against a real `treadle serve`: each quota answers 429 naming itself,
the SDK rides out the rate quota without losing a future, and an idle session expires,
freeing its adapters and keeping its checkpoints.

    .venv/bin/python -m pytest -q tests/server/tenancy/test_quotas.py
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from _tenancy import TINY, Api, make_tenants, start_server

HEARTBEAT_S = 8.0
WINDOW_S = 3.0  # the requests_per_minute window, shortened
AUTH_TTL_S = 0.5  # how long a tenant's quotas, read with its key, are trusted


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("quotas")
    keys = make_tenants(
        data,
        {
            "sess": None,  # its quota comes from the config file
            "adapt": {"max_adapters_in_memory": 2},
            "sizes": {"max_lora_rank": 8, "max_tokens_per_request": 40},
            "rate": {"requests_per_minute": 4},
            "idle": {"max_adapters_in_memory": 1},
        },
    )
    config = {
        "heartbeat_timeout_s": HEARTBEAT_S,
        "rate_window_s": WINDOW_S,
        "tenant_quotas": {"sess": {"max_concurrent_sessions": 2}},
        "auth_cache_ttl_s": AUTH_TTL_S,
    }
    srv = start_server({TINY: tiny_model_dir}, data, config=config)
    srv.keys = keys
    yield srv
    srv.stop()


def api(server, tenant: str) -> Api:
    return Api(server.url, server.keys[tenant])


def assert_quota(resp, quota: str, retry: bool) -> None:
    assert resp.status_code == 429, resp.text
    assert f"quota {quota} (" in resp.json()["error"]
    if retry:
        assert int(resp.headers["retry-after"]) >= 1
    else:
        assert resp.headers["x-should-retry"] == "false" and "retry-after" not in resp.headers


def test_concurrent_sessions(server):
    sess = api(server, "sess")
    first, _ = sess.session(), sess.session()
    over = sess.post("create_session", {})
    assert_quota(over, "max_concurrent_sessions", retry=True)
    assert "2 active sessions" in over.json()["error"]
    other = api(server, "adapt")  # another tenant is not affected
    assert all(other.session() for _ in range(3))
    sess.ok(f"sessions/{first}/finish", {})
    assert sess.session()


def test_adapters_in_memory(server):
    t = api(server, "adapt")
    sid = t.session()
    m0, m1 = t.model(sid, 0), t.model(sid, 1)
    body = {"session_id": sid, "model_seq_id": 2, "base_model": TINY, "lora_config": {"rank": 2}}
    assert_quota(t.post("create_model", body), "max_adapters_in_memory", retry=True)
    saved = t.done(
        t.ok("save_weights_for_sampler", {"model_id": m1, "seq_id": 1, "path": "s"})["request_id"]
    )["path"]
    loaded = {"session_id": sid, "sampling_session_seq_id": 0, "model_path": saved}
    assert_quota(t.post("create_sampling_session", loaded), "max_adapters_in_memory", retry=True)
    t.done(t.ok("unload_model", {"model_id": m0})["request_id"])  # frees a slot
    assert t.model(sid, 2)
    assert_quota(t.post("create_sampling_session", loaded), "max_adapters_in_memory", retry=True)


def test_rank_and_tokens_per_request(server):
    t = api(server, "sizes")
    sid = t.session()
    body = {"session_id": sid, "model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": 16}}
    over = t.post("create_model", body)
    assert_quota(over, "max_lora_rank", retry=False)
    assert "rank 16" in over.json()["error"]
    model = t.model(sid, 1, rank=8)
    big = t.forward(model, 1, [20, 21])
    assert_quota(big, "max_tokens_per_request", retry=False)
    assert "41 model-input tokens" in big.json()["error"]
    fits = t.forward(model, 2, [20, 20])  # the refused seq_id does not hold the model up
    assert "error" not in t.done(fits.json()["request_id"])
    sampler = t.sampler(sid)
    sample = {
        "sampling_session_id": sampler,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(range(5, 15))}]},
        "sampling_params": {"max_tokens": 16},
    }
    assert_quota(t.post("asample", sample), "max_tokens_per_request", retry=False)
    sample["sampling_params"]["max_tokens"] = 15  # 10 + 2 x 15 = 40
    assert t.post("asample", sample).status_code == 200

    from treadle import ServiceClient
    from treadle.client.errors import RateLimitError

    svc = ServiceClient(base_url=server.url, api_key=server.keys["sizes"])
    start = time.monotonic()
    with pytest.raises(RateLimitError, match="max_lora_rank"):
        svc.create_lora_training_client(TINY, rank=32)
    assert time.monotonic() - start < 10  # not retried: waiting cannot help
    svc.close()


def test_requests_per_minute_and_the_sdk_rides_it_out(server):
    t = api(server, "rate")
    sid = t.session()
    model = t.model(sid)  # one request of the window
    time.sleep(WINDOW_S)
    ok = [t.forward(model, seq, [5]) for seq in (1, 2, 3, 4)]
    assert [r.status_code for r in ok] == [200] * 4
    over = t.forward(model, 5, [5])
    assert_quota(over, "requests_per_minute", retry=True)
    time.sleep(float(over.headers["retry-after"]))
    again = t.forward(model, 5, [5])  # the same request, once the window has slid
    assert again.status_code == 200
    for r in [*ok, again]:
        assert "error" not in t.done(r.json()["request_id"])

    from treadle import Datum, ModelInput, ServiceClient

    svc = ServiceClient(base_url=server.url, api_key=server.keys["rate"])
    tc = svc.create_lora_training_client(TINY, rank=2)
    lengths = [3 + i for i in range(8)]
    futures = [
        tc.forward(
            [
                Datum(
                    model_input=ModelInput.from_ints(list(range(1, n + 1))),
                    loss_fn_inputs={
                        "target_tokens": list(range(2, n + 2)),
                        "weights": np.ones(n, np.float32),
                    },
                )
            ],
            "cross_entropy",
        )
        for n in lengths
    ]  # 8 requests against a quota of 4 per window: most get 429 first
    outs = [f.result(timeout=120) for f in futures]
    assert [o.loss_fn_outputs[0]["logprobs"].to_numpy().shape[0] for o in outs] == lengths
    svc.close()

    tinker = pytest.importorskip("tinker")  # the official SDK retries a 429 by itself
    from tinker import types as T

    sc = tinker.ServiceClient(base_url=server.url, api_key=server.keys["rate"])
    tc = sc.create_lora_training_client(base_model=TINY, rank=2).result()
    batches = [
        [
            T.Datum(
                model_input=T.ModelInput.from_ints(list(range(1, n + 1))),
                loss_fn_inputs={"target_tokens": list(range(2, n + 2)), "weights": [1.0] * n},
            )
        ]
        for n in lengths[:5]
    ]
    futures = [tc.forward(b, "cross_entropy") for b in batches]
    outs = [f.result(timeout=120) for f in futures]
    assert [len(o.loss_fn_outputs[0]["logprobs"].tolist()) for o in outs] == lengths[:5]
    sc.close("success").result(timeout=30)


def test_idle_session_expires_frees_memory_keeps_checkpoints(server):
    t = api(server, "idle")
    sid = t.session()
    model = t.model(sid)
    t.done(t.forward(model, 1, [6], backward=True).json()["request_id"])
    saved = t.done(
        t.ok("save_weights", {"model_id": model, "seq_id": 2, "path": "kept"})["request_id"]
    )["path"]
    body = {"session_id": sid, "model_seq_id": 1, "base_model": TINY, "lora_config": {"rank": 2}}
    assert_quota(t.post("create_model", body), "max_adapters_in_memory", retry=True)

    time.sleep(HEARTBEAT_S + 4)  # silence (any call of the session is a sign of life)
    gone = t.post("session_heartbeat", {"session_id": sid})
    assert gone.status_code == 410 and "expired" in gone.json()["error"]

    fresh = t.session()  # its adapter slot is free again, and the checkpoint is still there
    load = {"session_id": fresh, "model_seq_id": 0, "path": saved}
    reply = t.ok("load_weights", load)
    t.done(reply["request_id"])
    out = t.done(t.forward(reply["model_id"], 1, [6]).json()["request_id"])
    assert out["loss_fn_outputs"]


def test_set_quotas_from_the_cli_applies_within_the_auth_cache_ttl(server):
    def set_quotas(*flags: str) -> None:
        cmd = [sys.executable, "-m", "treadle.cli", "admin", "set-quotas", "sizes", *flags]
        subprocess.run(cmd + ["--data-dir", str(server.data_dir)], check=True, timeout=120)
        # the tenant's row is read again with its key once what was read is AUTH_TTL_S old
        time.sleep(AUTH_TTL_S)

    t = api(server, "sizes")

    def create(rank: int):  # a new session each time: the CLI may outlast a silent one's timeout
        body = {"session_id": t.session(), "model_seq_id": 0, "base_model": TINY}
        return t.post("create_model", {**body, "lora_config": {"rank": rank}})

    set_quotas("--max-lora-rank", "2")
    assert_quota(create(4), "max_lora_rank", retry=False)
    set_quotas("--max-lora-rank", "0")  # cleared: no rank quota at all any more
    assert create(16).status_code == 200
