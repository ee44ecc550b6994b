"""Containment at the edge, against a real `treadle serve` with tenants: what one
authenticated client cannot make the server do.

- values that cannot be meant are refused (non-finite, out of bounds, a LoRA rank over the
  model's width);
- integers outside int64 are a 400 naming the field, and the connection stays open;
- user_metadata is checked on the way in, so that reading a session back never fails;
- a signed download link with any token is a 404, never a 500;
- requests that would cost gigabytes (a sparse shape, a zstd bomb, a huge JSON body, a
  table of logprobs) are refused before anything is allocated;
- ops parked behind a missing seq_id are bounded in count and bytes, and time out.

    .venv/bin/python -m pytest -q tests/acceptance/test_containment_edge.py
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from _tenancy import TINY, Api, fb_body, make_tenants, start_server

from treadle.wire import tinker_pb2 as pb

INT64_OVER = 2**64  # beyond SQLite's and numpy's int64
PARK = {"max_parked_ops": 3, "max_parked_bytes": 1 << 20, "parked_op_timeout_s": 4.0}
LIMITS = {"max_result_cells": 100_000}
QUOTAS = {"max_concurrent_sessions": 50, "max_adapters_in_memory": 20, "max_lora_rank": 256}
ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("containment-edge")
    keys = make_tenants(data, {"alice": QUOTAS, "bob": QUOTAS})
    srv = start_server(
        {TINY: tiny_model_dir}, data, config={"limits": LIMITS, **PARK}, process=True
    )
    srv.keys = keys
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def alice(server):
    api = Api(server.url, server.keys["alice"])
    yield api
    api.close()


@pytest.fixture(scope="module")
def model(alice):
    """A training model of alice's (seq 0 is its create; tests take seq_ids from `seqs`)."""
    sid = alice.session()
    return sid, alice.model(sid, rank=4)


_next_seq = {"n": 1}


def seq() -> int:
    _next_seq["n"] += 1
    return _next_seq["n"] - 1


def _error(resp: httpx.Response) -> str:
    return resp.json().get("error", "")


def _failed(api: Api, request_id: str, wait_s: float = 60.0) -> str:
    """The error of a future that must fail (within wait_s)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        body = api.post("retrieve_future", {"request_id": request_id}).json()
        if body.get("type") != "try_again":
            assert "error" in body, body
            return body["error"]
    raise AssertionError(f"request {request_id} still pending after {wait_s} s")


# ---- 1. values that cannot be meant -------------------------------------------------------
def _fb(model_id: str, seq_id: int, loss_fn: str, inputs: dict, T: int = 4, config=None) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn)
    for key, value in (config or {}).items():
        msg.loss_fn_config[key] = value
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(1, T + 1, dtype="<i4").tobytes()
    for key, array in inputs.items():
        array = np.asarray(array)
        dtype = pb.DTYPE_INT64 if array.dtype.kind == "i" else pb.DTYPE_FLOAT32
        t = d.loss_fn_inputs[key]
        t.dtype, t.shape[:] = dtype, list(array.shape)
        t.dense = array.astype("<i8" if dtype == pb.DTYPE_INT64 else "<f4").tobytes()
    return msg.SerializeToString()


def test_non_finite_and_unbounded_values_are_refused(alice, model):
    _, mid = model
    targets = np.array([2, 3, 4, 5])
    cases = {
        "weights NaN": ("cross_entropy", {"target_tokens": targets, "weights": [1, np.nan, 1, 1]}),
        "weights inf": ("cross_entropy", {"target_tokens": targets, "weights": [1, np.inf, 1, 1]}),
        "advantages 1e7": (
            "importance_sampling",
            {"target_tokens": targets, "logprobs": [-1.0] * 4, "advantages": [1e7, 0, 0, 0]},
        ),
    }
    for what, (loss_fn, inputs) in cases.items():
        resp = alice.http.post("/api/v1/forward_backward", content=_fb(mid, seq(), loss_fn, inputs))
        assert resp.status_code == 400, (what, resp.text)
        assert "weights" in _error(resp) or "advantages" in _error(resp), (what, resp.text)
    nan_config = _fb(mid, seq(), "ppo", {"target_tokens": targets, "logprobs": [-1.0] * 4,
                                         "advantages": [0.0] * 4},
                     config={"clip_low_threshold": math.nan})  # fmt: skip
    resp = alice.http.post("/api/v1/forward_backward", content=nan_config)
    assert resp.status_code == 400 and "clip_low_threshold" in _error(resp), resp.text
    for lr in (100.0, "NaN", "Infinity"):
        body = json.dumps({"model_id": mid, "seq_id": seq(), "adam_params": {**ADAM}})
        body = body.replace('"learning_rate": 0.001', f'"learning_rate": {lr}')
        resp = alice.http.post("/api/v1/optim_step", content=body, headers=_JSON)
        assert resp.status_code == 400 and "learning_rate" in _error(resp), (lr, resp.text)


_JSON = {"content-type": "application/json"}


def test_lora_rank_over_the_models_width_is_refused(alice):
    sid = alice.session()
    for i, rank in enumerate((2**31, 129)):
        body = {"session_id": sid, "model_seq_id": i, "base_model": TINY,
                "lora_config": {"rank": rank}}  # fmt: skip
        t0 = time.monotonic()
        resp = alice.post("create_model", body)
        assert resp.status_code == 400, resp.text
        assert "rank" in _error(resp) and "128" in _error(resp), resp.text
        assert time.monotonic() - t0 < 5  # refused at the edge, nothing allocated
    assert alice.model(sid, seq=5, rank=128)  # the model's width itself is fine (the demo's)


# ---- 5. integers outside int64, user_metadata, signed links ------------------------------
def _port(resp: httpx.Response) -> int:
    """The client-side port of the connection that carried this response."""
    return resp.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_integers_beyond_int64_are_400_naming_the_field(alice, model):
    sid, mid = model
    big = INT64_OVER
    calls = [
        ("optim_step", {"model_id": mid, "seq_id": big, "adam_params": ADAM}, "seq_id"),
        ("save_weights", {"model_id": mid, "seq_id": big, "path": "x"}, "seq_id"),
        ("save_weights_for_sampler", {"model_id": mid, "seq_id": big, "path": "x"}, "seq_id"),
        ("save_weights_for_sampler", {"model_id": mid, "seq_id": seq(),
                                      "sampling_session_seq_id": big}, "sampling_session_seq_id"),
        ("create_sampling_session", {"session_id": sid, "sampling_session_seq_id": big,
                                     "base_model": TINY}, "sampling_session_seq_id"),
        ("create_model", {"session_id": sid, "model_seq_id": big, "base_model": TINY},
         "model_seq_id"),
        ("load_weights", {"model_id": mid, "seq_id": big, "path": "tinker://r/weights/x"},
         "seq_id"),
        ("asample", {"sampling_session_id": "s", "seq_id": big, "num_samples": 1,
                     "prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": {}},
         "seq_id"),
        ("asample", {"sampling_session_id": "s", "seq_id": 0, "num_samples": -big,
                     "prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": {}},
         "num_samples"),
    ]  # fmt: skip
    queries = [
        ("sessions", "limit"),
        ("sessions", "offset"),
        ("training_runs", "limit"),
        ("training_runs", "offset"),
        ("checkpoints", "limit"),
        ("checkpoints", "offset"),
    ]
    first = alice.get("healthz")
    for path, body, field in calls:
        resp = alice.post(path, body)
        assert resp.status_code == 400, (path, resp.status_code, resp.text)
        assert field in _error(resp), (path, resp.text)
    for path, param in queries:
        resp = alice.get(path, params={param: str(big)})
        assert resp.status_code == 400 and param in _error(resp), (path, param, resp.text)
    alice.ok("create_model", {"session_id": sid, "model_seq_id": 9, "base_model": TINY,
                              "lora_config": {"rank": 2}, "model_package_group": "ints"})  # fmt: skip
    resp = alice.http.put(
        "/api/v1/treadle/checkpoints/groups/ints/retention", json={"keep_last": big}
    )
    assert resp.status_code == 400 and "keep_last" in _error(resp), resp.text
    # every refusal was answered on the connection the first request opened
    assert _port(alice.get("healthz")) == _port(first)


def test_user_metadata_is_checked_on_the_way_in(alice, model):
    sid, mid = model
    resp = alice.post("create_session", {"user_metadata": {"a": 1}})
    assert resp.status_code == 400 and "user_metadata" in _error(resp), resp.text
    too_many = {f"k{i}": "v" for i in range(1000)}
    resp = alice.post("create_session", {"user_metadata": too_many})
    assert resp.status_code == 400 and "user_metadata" in _error(resp), resp.text
    resp = alice.post("create_session", {"user_metadata": {"a": "x" * 100_000}})
    assert resp.status_code == 400 and "user_metadata" in _error(resp), resp.text
    meta = {"team": "rl", "run": "7"}
    created = alice.ok("create_session", {"user_metadata": meta})["session_id"]
    got = alice.get(f"sessions/{created}")
    assert got.status_code == 200 and got.json()["user_metadata"] == meta, got.text
    resp = alice.post("create_model", {"session_id": sid, "model_seq_id": 7, "base_model": TINY,
                                       "user_metadata": {"a": [1]}})  # fmt: skip
    assert resp.status_code == 400 and "user_metadata" in _error(resp), resp.text
    resp = alice.post("save_weights", {"model_id": mid, "seq_id": seq(), "path": "m",
                                       "user_metadata": {"a": 1}})  # fmt: skip
    assert resp.status_code == 400 and "user_metadata" in _error(resp), resp.text


def test_a_signed_link_with_any_token_is_a_404(server):
    anon = httpx.Client(base_url=server.url, timeout=30)
    for token in ("abc.déf", "ab\u00e9c.0123", "\u2603.\u2603", "...", "x" * 5000 + ".y"):
        resp = anon.get(f"/api/v1/treadle/files/{token}/adapter_config.json")
        assert resp.status_code == 404, (token, resp.status_code, resp.text)
    anon.close()


# ---- 3. small requests that would cost gigabytes ------------------------------------------
def csr_weights_body(model_id: str, seq_id: int, cols: int = 5_000_000) -> bytes:
    """A forward_backward whose weights is a sparse CSR tensor [4, cols] with no values."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(1, 5, dtype="<i4").tobytes()
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype, t.shape[:] = pb.DTYPE_INT64, [4]
    t.dense = np.arange(2, 6, dtype="<i8").tobytes()
    w = d.loss_fn_inputs["weights"]
    w.dtype, w.shape[:] = pb.DTYPE_FLOAT32, [4, cols]
    w.sparse_csr.crow_indices = np.zeros(5, dtype="<i8").tobytes()
    return msg.SerializeToString()


def sparse_target_sample(sampler: str, P: int = 3, cols: int = 20_000_000) -> dict:
    """A sample request whose target_prompt_logprobs is sparse CSR [P-1, cols], no values."""
    return {
        "sampling_session_id": sampler,
        "seq_id": 0,
        "num_samples": 1,
        "prompt": {"chunks": [{"tokens": list(range(1, P + 1))}]},
        "sampling_params": {"max_tokens": 1},
        "prompt_logprobs": True,
        "target_prompt_logprobs": {
            "data": [],
            "dtype": "int64",
            "shape": [P - 1, cols],
            "sparse_crow_indices": [0] * P,
            "sparse_col_indices": [],
        },
    }


def zstd_bomb(inflated: int = 512 << 20) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor(level=19).compress(b"\0" * inflated)


def test_a_sparse_weights_shape_is_refused_before_densifying(alice, model):
    _, mid = model
    body = csr_weights_body(mid, seq())
    assert len(body) < 300
    resp = alice.http.post("/api/v1/forward_backward", content=body)
    assert resp.status_code == 400 and "weights" in _error(resp), resp.text
    assert "limit" in _error(resp), resp.text


def test_a_sparse_target_table_is_refused_before_densifying(alice, model):
    sid, _ = model
    sampler = alice.ok("create_sampling_session", {"session_id": sid,
                       "sampling_session_seq_id": 50, "base_model": TINY})  # fmt: skip
    resp = alice.post("asample", sparse_target_sample(sampler["sampling_session_id"]))
    assert resp.status_code == 400 and "target_prompt_logprobs" in _error(resp), resp.text


def test_a_table_of_logprobs_is_counted_before_sampling(alice, model):
    sid, _ = model
    sampler = alice.ok("create_sampling_session", {"session_id": sid,
                       "sampling_session_seq_id": 51, "base_model": TINY})  # fmt: skip
    body = {
        "sampling_session_id": sampler["sampling_session_id"],
        "num_samples": 1,
        "prompt": {"chunks": [{"tokens": [3] * 400}]},
        "sampling_params": {"max_tokens": 1},
        "prompt_logprobs": True,
        "topk_prompt_logprobs": 300,  # 399 × 300 cells, over max_result_cells
    }
    resp = alice.post("asample", body)
    assert resp.status_code == 400 and "max_result_cells" in _error(resp), resp.text
    body["topk_prompt_logprobs"] = 20  # well inside: it samples
    alice.done(alice.ok("asample", body)["request_id"])


def test_a_zstd_bomb_is_capped_while_it_inflates(alice, model):
    _, mid = model
    bomb = zstd_bomb()
    assert len(bomb) < 64 << 10
    headers = {"content-encoding": "zstd", "content-type": "application/x-protobuf"}
    resp = alice.http.post("/api/v1/forward_backward", content=bomb, headers=headers)
    assert resp.status_code == 413 and "limit" in _error(resp), resp.text


def test_every_body_is_capped_before_it_is_parsed(alice, model):
    sid, _ = model
    big = b'{"tags": [' + b'"x",' * (2 << 20) + b'"x"]}'  # 8 MiB of JSON
    for body in (big, iter([big[i : i + 65536] for i in range(0, len(big), 65536)])):
        resp = alice.http.post("/api/v1/create_session", content=body, headers=_JSON)
        assert resp.status_code == 413 and "limit" in _error(resp), resp.text[:300]
    assert alice.get("healthz").status_code == 200


# ---- 3. ops parked behind a missing seq_id ------------------------------------------------
def test_parked_ops_are_bounded_and_time_out(alice):
    sid = alice.session()
    mid = alice.model(sid)
    # seq 1 never comes: 2, 3, 4 park (max_parked_ops 3); 5 is one too many
    parked = [alice.forward(mid, s, [5]).json()["request_id"] for s in (2, 3, 4)]
    over = alice.forward(mid, 5, [5])
    assert over.status_code in (200, 400, 429), over.text
    error = _failed(alice, over.json()["request_id"]) if over.status_code == 200 else _error(over)
    assert "max_parked_ops 3" in error and "seq_id 1" in error, error
    t0 = time.monotonic()
    for rid in parked:  # each fails once it waited parked_op_timeout_s for seq_id 1
        error = _failed(alice, rid)
        assert "seq_id 1" in error and "parked_op_timeout_s" in error, error
    assert time.monotonic() - t0 < 60
    # the model carries on after the cancelled ones; the lost seq_id is closed
    alice.done(alice.forward(mid, 6, [5]).json()["request_id"])
    late = alice.forward(mid, 1, [5])  # the worker owns the order: its future fails
    error = _failed(alice, late.json()["request_id"]) if late.status_code == 200 else _error(late)
    assert "seq_id" in error and "continues from seq_id 7" in error, error


def test_parked_ops_are_bounded_in_bytes(alice):
    sid = alice.session()
    mid = alice.model(sid)
    big = alice.http.post("/api/v1/forward_backward", content=fb_body(mid, 2, [1000] * 60))
    assert big.status_code in (200, 400), big.text
    error = _failed(alice, big.json()["request_id"]) if big.status_code == 200 else _error(big)
    assert "max_parked_bytes" in error and "seq_id 1" in error, error
    small = alice.forward(mid, 3, [5]).json()["request_id"]  # still fits
    alice.done(alice.forward(mid, 1, [5]).json()["request_id"])  # the gap fills: both run
    alice.done(small)


# ---- the server stays responsive while it refuses ----------------------------------------
def _rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _while_refused(server, fire) -> tuple[httpx.Response, list[float], float]:
    """Fire one request on a thread; meanwhile poll healthz (its latencies) and watch the
    server's resident memory (→ the largest growth, MB)."""
    pid = server.proc.pid
    before = _rss_mb(pid)
    with contextlib.suppress(OSError):  # reset the peak, where the kernel lets us
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(resp=fire()))
    probe = httpx.Client(base_url=server.url, timeout=30)
    probe.get("/api/v1/healthz")  # connected before the clock starts
    latencies, peak = [], before
    worker.start()
    t0 = time.monotonic()
    while worker.is_alive() or time.monotonic() - t0 < 0.5:
        start = time.perf_counter()
        assert probe.get("/api/v1/healthz").status_code == 200
        latencies.append(time.perf_counter() - start)
        peak = max(peak, _rss_mb(pid))
        time.sleep(0.01)
    worker.join()
    probe.close()
    with contextlib.suppress(KeyError):
        peak = max(peak, _rss_mb(pid, "VmHWM"))
    return out["resp"], latencies, peak - before


def test_healthz_stays_fast_while_hostile_requests_are_refused(server, alice):
    sid = alice.session()
    mid = alice.model(sid)
    sampler = alice.ok("create_sampling_session", {"session_id": sid,
                       "sampling_session_seq_id": 52, "base_model": TINY})["sampling_session_id"]  # fmt: skip
    bomb = zstd_bomb()
    huge_json = json.dumps(
        {**sparse_target_sample(sampler, P=3, cols=4), "target_prompt_logprobs": {
            "data": [1] * 20_000_000, "dtype": "int64", "shape": [2, 10_000_000]}}
    ).encode()  # fmt: skip
    zstd = {"content-encoding": "zstd"}
    hostile = {
        "sparse weights [4, 5e6]": lambda: alice.http.post(
            "/api/v1/forward_backward", content=csr_weights_body(mid, 1)
        ),
        "sparse target_prompt_logprobs [2, 2e7]": lambda: alice.post(
            "asample", sparse_target_sample(sampler)
        ),
        "16 KB of zstd inflating to 512 MB": lambda: alice.http.post(
            "/api/v1/forward_backward", content=bomb, headers=zstd
        ),
        "a 100 MB JSON target_prompt_logprobs": lambda: alice.http.post(
            "/api/v1/asample", content=huge_json, headers=_JSON
        ),
    }
    for what, fire in hostile.items():
        resp, latencies, grew_mb = _while_refused(server, fire)
        assert resp.status_code in (400, 413), (what, resp.status_code, resp.text[:300])
        latencies.sort()
        median, worst = latencies[len(latencies) // 2], latencies[-1]
        print(
            f"{what}: healthz median {median * 1e3:.1f} ms, max {worst * 1e3:.1f} ms, +{grew_mb:.0f} MB"
        )
        assert worst < 0.5 and median < 0.1, (
            what,
            f"healthz median {median:.3f} s, max {worst:.3f} s",
        )
        assert grew_mb < 200, (what, f"server memory grew {grew_mb:.0f} MB")
