"""Raw HTTP against a real server: ordering, idempotency, long polls, bad input, stubs.

Requests are built with the official tinker SDK's own protobuf encoder and read with its
decoder, so these tests do not lean on our codec.
"""

from __future__ import annotations

import io
import json
import threading
import time
import zipfile

import httpx
import numpy as np
import pytest
from _inproc import InProcessServer

tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

PROTO = "application/x-protobuf"
TINY_MODEL_NAME = "treadle/tiny-llama"  # as tests/conftest.py serves it
SECOND_MODEL = "second/tiny"


class Raw:
    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url + "/api/v1", timeout=60)

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        return self.http.post(path, json=body, **kw)

    def ok(self, path: str, body=None, **kw) -> dict:
        r = self.post(path, body, **kw)
        assert r.status_code == 200, r.text
        return r.json()

    def session(self) -> str:
        return self.ok("/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "t"})[
            "session_id"
        ]

    def retrieve(self, rid: str, proto: bool = False) -> httpx.Response:
        headers = {"Accept": PROTO} if proto else {}
        return self.post("/retrieve_future", {"request_id": rid}, headers=headers)

    def wait(self, rid: str, proto: bool = False, timeout: float = 60) -> httpx.Response:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.retrieve(rid, proto)
            assert r.status_code == 200, r.text
            if PROTO in r.headers["content-type"] or r.json().get("type") != "try_again":
                return r
        raise TimeoutError(rid)

    def model(self, sid: str, base: str, model_seq_id: int = 0) -> str:
        body = {
            "session_id": sid,
            "model_seq_id": model_seq_id,
            "base_model": base,
            "lora_config": {"rank": 2},
        }
        fut = self.ok("/create_model", body)
        assert self.wait(fut["request_id"]).json()["model_id"] == fut["model_id"]
        return fut["model_id"]

    def fwd(
        self, model_id: str, seq: int, data, loss="cross_entropy", forward_only=False, config=None
    ) -> httpx.Response:
        req = T.ForwardBackwardRequest(
            forward_backward_input=T.ForwardBackwardInput(
                data=data, loss_fn=loss, loss_fn_config=config
            ),
            model_id=model_id,
            seq_id=seq,
        )
        msg = forward_backward_request_to_proto(req)
        msg.forward_only = forward_only
        return self.http.post(
            "/forward_backward", content=msg.SerializeToString(), headers={"Content-Type": PROTO}
        )

    def fwd_result(self, rid: str):
        r = self.wait(rid, proto=True)
        assert PROTO in r.headers["content-type"], r.text
        return deserialize_forward_backward_output(r.content)


def datum(tokens: list[int], targets: list[int] | None = None) -> T.Datum:
    targets = targets if targets is not None else [t + 1 for t in tokens]
    return T.Datum(
        model_input=T.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(targets)},
    )


def logprobs(out) -> np.ndarray:
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


@pytest.fixture(scope="module")
def fast_server(tiny_model_dir, tmp_path_factory):
    """Short long polls (try_again after 1 s), a short heartbeat timeout, two models."""
    # not `from conftest import ...`: with tests/client collected too, that name is theirs
    server = InProcessServer(
        {TINY_MODEL_NAME: tiny_model_dir, SECOND_MODEL: tiny_model_dir},
        tmp_path_factory.mktemp("fast"),
        config={"long_poll_s": 1.0, "heartbeat_timeout_s": 4.0},
        startup_timeout_s=180,
    ).start()
    yield server
    server.stop()


def test_out_of_order_requests_run_in_seq_order_and_resubmits_run_once(fast_server):
    raw = Raw(fast_server.url)
    model = raw.model(raw.session(), fast_server.model_name)
    data = [datum([3, 4, 5, 6])]
    optim = {"model_id": model, "seq_id": 3, "adam_params": {"learning_rate": 0.05}}
    r4 = raw.fwd(model, 4, data, forward_only=True).json()["request_id"]
    r3 = raw.ok("/optim_step", optim)["request_id"]
    r2 = raw.fwd(model, 2, data).json()["request_id"]
    assert raw.retrieve(r4).json()["type"] == "try_again"  # seq 1 is missing: all wait
    assert raw.retrieve(r2).json()["type"] == "try_again"
    assert request_row(fast_server, r2)["status"] == "pending"  # on disk before the reply
    r1 = raw.fwd(model, 1, data, forward_only=True).json()["request_id"]
    lp1, lp2, lp4 = (logprobs(raw.fwd_result(r)) for r in (r1, r2, r4))
    # a result the client has seen is on disk, and a second poll gets it again from there
    assert request_row(fast_server, r4)["status"] == "done"
    np.testing.assert_array_equal(logprobs(raw.fwd_result(r4)), lp4)
    np.testing.assert_allclose(lp2, lp1, atol=1e-6)  # nothing changed the weights before 2
    assert np.abs(lp4 - lp1).max() > 1e-3  # the optim_step (3) ran before 4

    # resubmissions get the original request ids and run no second time
    assert raw.fwd(model, 2, data).json()["request_id"] == r2
    assert raw.ok("/optim_step", optim)["request_id"] == r3
    lp5 = logprobs(raw.fwd_result(raw.fwd(model, 5, data, forward_only=True).json()["request_id"]))
    np.testing.assert_allclose(lp5, lp4, atol=1e-6)
    assert request_row(fast_server, r2)["train_tokens"] == 4  # usage, recorded per request


def test_a_resubmit_to_an_unloaded_model_gets_its_original_future(fast_server):
    """A client whose reply was lost (the server crashed between the commit and the reply)
    sends the request again; if the model is gone by then, the resubmission still gets the
    request it was filed as, and a request never filed gets the 404."""
    raw = Raw(fast_server.url)
    model = raw.model(raw.session(), fast_server.model_name)
    fwd = raw.fwd(model, 1, [datum([3, 4, 5])]).json()["request_id"]
    optim = {"model_id": model, "seq_id": 2, "adam_params": {"learning_rate": 0.05}}
    step = raw.ok("/optim_step", optim)["request_id"]
    raw.wait(step)
    raw.wait(raw.ok("/unload_model", {"model_id": model})["request_id"])

    assert raw.fwd(model, 1, [datum([3, 4, 5])]).json()["request_id"] == fwd
    assert raw.ok("/optim_step", optim)["request_id"] == step
    assert raw.wait(step).json()["metrics"]  # its result, as before
    late = raw.post("/optim_step", {**optim, "seq_id": 3})
    assert late.status_code == 404 and "was unloaded" in late.json()["error"]


def request_row(server, request_id: str) -> dict:
    import sqlite3

    with sqlite3.connect(server.data_dir / "treadle.db") as db:
        db.row_factory = sqlite3.Row
        row = db.execute("SELECT * FROM requests WHERE request_id = ?", (request_id,)).fetchone()
    return dict(row)


def test_sample_resubmit_and_json_results(fast_server):
    raw = Raw(fast_server.url)
    sid = raw.session()
    sampler = raw.ok(
        "/create_sampling_session",
        {"session_id": sid, "sampling_session_seq_id": 0, "base_model": fast_server.model_name},
    )["sampling_session_id"]
    assert raw.http.get(f"/samplers/{sampler}").json()["base_model"] == fast_server.model_name
    body = {
        "sampling_session_id": sampler,
        "seq_id": 0,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": 4, "temperature": 1.0, "seed": 1},
        "prompt_logprobs": True,
    }
    fut = raw.ok("/asample", body)
    assert len(fut["sample_sequence_ids"]) == 2
    assert raw.ok("/asample", body)["request_id"] == fut["request_id"]
    proto = deserialize_sample_response(raw.wait(fut["request_id"], proto=True).content)
    js = raw.wait(fut["request_id"]).json()  # the same result, as JSON for JSON clients
    assert [s["tokens"] for s in js["sequences"]] == [s.tokens for s in proto.sequences]
    assert [s["sequence_id"] for s in js["sequences"]] == fut["sample_sequence_ids"]
    assert js["prompt_logprobs"][0] is None
    np.testing.assert_allclose(js["prompt_logprobs"][1:], proto.prompt_logprobs[1:], rtol=1e-6)
    usage = request_row(fast_server, fut["request_id"])
    assert usage["prompt_tokens"] == 3
    assert usage["sampled_tokens"] == sum(len(s.tokens) for s in proto.sequences)


def test_each_served_model_has_its_own_engine(fast_server):
    raw = Raw(fast_server.url)
    caps = raw.http.get("/get_server_capabilities").json()["supported_models"]
    assert sorted(m["model_name"] for m in caps) == sorted([fast_server.model_name, SECOND_MODEL])
    sid = raw.session()
    a = raw.model(sid, fast_server.model_name, model_seq_id=0)
    b = raw.model(sid, SECOND_MODEL, model_seq_id=1)
    assert raw.ok("/get_info", {"model_id": b})["model_data"]["model_name"] == SECOND_MODEL
    data = [datum([3, 4, 5])]
    outs = [
        raw.fwd_result(raw.fwd(m, 1, data, forward_only=True).json()["request_id"]) for m in (a, b)
    ]
    np.testing.assert_allclose(logprobs(outs[0]), logprobs(outs[1]), atol=1e-6)  # same weights
    r = raw.http.get(f"/treadle/models/{SECOND_MODEL}/tokenizer")
    assert r.status_code == 200


def test_long_poll_returns_the_moment_the_result_is_written(treadle_server):
    """The session server holds polls 30 s: a result written mid-poll must end it at once."""
    raw = Raw(treadle_server.url)
    model = raw.model(raw.session(), treadle_server.model_name)
    r2 = raw.fwd(model, 2, [datum([1, 2, 3])], forward_only=True).json()["request_id"]
    got: dict = {}

    def poll():
        t0 = time.monotonic()
        got["response"] = Raw(treadle_server.url).retrieve(r2, proto=True)
        got["elapsed"] = time.monotonic() - t0

    thread = threading.Thread(target=poll)
    thread.start()
    time.sleep(0.5)
    raw.fwd(model, 1, [datum([1, 2, 3])], forward_only=True)
    thread.join(40)
    assert PROTO in got["response"].headers["content-type"]
    assert got["elapsed"] < 10  # far below the 30 s hold: woken by the write, not a timer


def test_bad_input_gets_a_4xx_naming_the_problem_and_the_session_goes_on(
    fast_server, tiny_model_dir
):
    raw = Raw(fast_server.url)
    sid = raw.session()
    model = raw.model(sid, fast_server.model_name)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    cases = [
        (raw.fwd(model, 1, [datum([1, vocab + 3])]), 400, "outside the vocabulary"),
        (raw.fwd(model, 2, [datum([1, 2, 3], [2, 3])]), 400, "expected leading length 3"),
        (raw.fwd(model, 3, [datum([1, 2])], loss="no_such_loss"), 400, "loss_fn"),
        (raw.fwd(model, 4, [datum([1, 2])], loss="ppo"), 400, "needs 'logprobs'"),
        (raw.fwd("nope:train:0", 1, [datum([1, 2])]), 404, "not found"),
        (raw.http.post("/forward_backward", content=b"\x0a\xff\xff"), 400, "not a valid protobuf"),
        (raw.post("/retrieve_future", {"request_id": "no-such-id"}), 404, "no-such-id"),
        (
            raw.post("/create_model", {"session_id": sid, "model_seq_id": 1, "base_model": "nope"}),
            400,
            "not served",
        ),
        (raw.post("/create_model", {"session_id": sid, "model_seq_id": 1}), 400, "base_model"),
        (raw.post("/save_weights", {"model_id": model, "seq_id": 5, "path": "../x"}), 400, "path"),
        (raw.post("/optim_step", {"model_id": model, "seq_id": 6}), 400, "adam_params"),
    ]
    for response, status, needle in cases:
        assert response.status_code == status, response.text
        assert needle in response.json()["error"], response.text
    # the refused requests used up seq 1..6: the next one runs at once
    out = raw.fwd_result(raw.fwd(model, 7, [datum([1, 2])]).json()["request_id"])
    assert np.isfinite(out.metrics["loss:sum"])

    # an error only the engine loop sees becomes a failed future with category "user"
    save = {"model_id": model, "seq_id": 8, "path": "twice"}
    assert "path" in raw.wait(raw.ok("/save_weights", save)["request_id"]).json()
    again = raw.wait(raw.ok("/save_weights", {**save, "seq_id": 9})["request_id"]).json()
    assert again["category"] == "user" and "already exists" in again["error"]
    out = raw.fwd_result(raw.fwd(model, 10, [datum([1, 2])]).json()["request_id"])
    assert np.isfinite(out.metrics["loss:sum"])


def test_silent_session_expires_and_finish_ends_a_session(fast_server):
    raw = Raw(fast_server.url)
    quiet, closed = raw.session(), raw.session()
    model = raw.model(quiet, fast_server.model_name)
    raw.model(closed, fast_server.model_name)
    assert raw.post(f"/sessions/{closed}/finish", {"reason": {"type": "success"}}).json() == {}
    r = raw.post("/session_heartbeat", {"session_id": closed})
    assert r.status_code == 410 and "finished" in r.json()["error"]
    time.sleep(6.5)  # > heartbeat_timeout_s (4) + the reaper's period (1)
    r = raw.fwd(model, 1, [datum([1, 2])])
    assert r.status_code == 410 and "expired" in r.json()["error"]
    assert raw.post("/session_heartbeat", {"session_id": quiet}).status_code == 410


def test_stubs_listings_and_tokenizer(treadle_server, tiny_model_dir, tmp_path):
    raw = Raw(treadle_server.url)
    assert raw.http.get("/healthz").json() == {"status": "ok"}
    assert raw.ok("/client/config", {"sdk_version": "0.38.0"})["pjwt_auth_enabled"] is False
    assert "refresh_interval_sec" in raw.ok("/client/dynamic_config", {"sdk_version": "0.38.0"})
    assert raw.ok("/telemetry", {"events": []}) == {"status": "accepted"}
    caps = raw.http.get("/get_server_capabilities").json()["supported_models"]
    assert [m["model_name"] for m in caps] == [treadle_server.model_name]

    sid = raw.session()
    model = raw.model(sid, treadle_server.model_name)
    assert raw.ok("/session_heartbeat", {"session_id": sid})["type"] == "session_heartbeat"
    info = raw.ok("/get_info", {"model_id": model})
    assert info["model_data"]["model_name"] == treadle_server.model_name
    saved = raw.wait(
        raw.ok("/save_weights", {"model_id": model, "seq_id": 1, "path": "c1"})["request_id"]
    ).json()["path"]
    run_id = saved.split("/")[2]
    assert raw.ok("/weights_info", {"tinker_path": saved})["lora_rank"] == 2
    run = raw.http.get(f"/training_runs/{run_id}").json()
    assert run["base_model"] == treadle_server.model_name
    assert run["last_checkpoint"]["tinker_path"] == saved
    assert raw.http.get(f"/training_runs/{model}").json()["training_run_id"] == run_id
    ckpts = raw.http.get(f"/training_runs/{run_id}/checkpoints").json()["checkpoints"]
    assert [c["checkpoint_id"] for c in ckpts] == ["weights/c1"]
    assert saved in {c["tinker_path"] for c in raw.http.get("/checkpoints").json()["checkpoints"]}
    assert run_id in {
        r["training_run_id"] for r in raw.http.get("/training_runs").json()["training_runs"]
    }
    assert model in raw.http.get(f"/sessions/{sid}").json()["training_run_ids"]
    unload = raw.ok("/unload_model", {"model_id": model})
    assert raw.wait(unload["request_id"]).json()["model_id"] == model
    gone = raw.post("/get_info", {"model_id": model})
    assert gone.status_code == 404 and "was unloaded" in gone.json()["error"]
    assert raw.ok("/weights_info", {"tinker_path": saved})["base_model"]  # checkpoints stay

    r = raw.http.get(f"/treadle/models/{treadle_server.model_name}/tokenizer")
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
    zipfile.ZipFile(io.BytesIO(r.content)).extractall(tmp_path / "tok")
    from transformers import AutoTokenizer

    text = "Ana has 12 apples and buys 7 more."
    assert AutoTokenizer.from_pretrained(tmp_path / "tok").encode(
        text
    ) == AutoTokenizer.from_pretrained(tiny_model_dir).encode(text)
    assert raw.http.get("/treadle/models/nope/tokenizer").status_code == 404
