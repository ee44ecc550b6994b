"""Two API processes on one PostgreSQL database, in-process: an engine host (its engine on a
thread) and a frontend, each a create_app under a TestClient, so that the cases around the
loop cost no server start: polls answered where the request was not filed, control calls,
sessions and models ended at one and freed at the other, the OpenAI routes of a frontend,
notifications missed while a listener reconnects, a second engine host refused.

    .venv/bin/python -m pytest -q tests/postgres/test_shared_units.py
"""

from __future__ import annotations

import io
import shutil
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psycopg
import pytest
from fastapi.testclient import TestClient

from treadle.server.app import create_app
from treadle.server.config import ServerConfig
from treadle.server.storage.rows import CheckpointRow
from treadle.types import Datum, ModelInput, TensorData
from treadle.wire import codec

TINY = "treadle/tiny-llama"


@pytest.fixture(scope="module")
def pair(postgres, tiny_model_dir, tmp_path_factory) -> Iterator[tuple]:
    url = postgres.create_database("pair")
    data = tmp_path_factory.mktemp("pair")
    common = {
        "models": {TINY: str(tiny_model_dir)},
        "data_dir": str(data),
        "db_url": url,
        "engine_processes": False,
        "long_poll_s": 5.0,
    }
    with TestClient(create_app(ServerConfig(**common))) as host:
        with TestClient(create_app(ServerConfig(**common, engine_host=False))) as front:
            yield host, front, url, common


def post(client: TestClient, path: str, body=None, **kw):
    return client.post(f"/api/v1/{path}", json=body, **kw)


def ok(client: TestClient, path: str, body=None) -> dict:
    r = post(client, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def result(client: TestClient, request_id: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = ok(client, "retrieve_future", {"request_id": request_id})
        if r.get("type") != "try_again":
            return r
    raise TimeoutError(request_id)


def session(client: TestClient) -> str:
    return ok(client, "create_session", {"tags": []})["session_id"]


def model(client: TestClient, sid: str, seq: int = 0) -> tuple[str, str]:
    body = {"session_id": sid, "model_seq_id": seq, "base_model": TINY, "lora_config": {"rank": 4}}
    reply = ok(client, "create_model", body)
    return reply["model_id"], reply["request_id"]


def fwd(client: TestClient, model_id: str, seq_id: int):
    tokens = [3, 4, 5, 6, 7]
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(np.array(tokens[1:])),
            "weights": TensorData.from_numpy(np.ones(4, np.float32)),
        },
    )
    body = codec.encode_forward_backward_request(
        model_id, seq_id, [datum], "cross_entropy", None, False
    )
    return client.post("/api/v1/forward_backward", content=body)


def eventually(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.05)


def host_engine(host: TestClient):
    return host.app.state.server.engines.get(TINY)


def test_requests_filed_at_one_are_answered_at_the_other(pair):
    host, front, _, _ = pair
    sid = session(front)
    mid, created = model(front, sid)  # made at the frontend
    assert model(host, sid) == (mid, created)  # the same request again, at the host
    assert "error" not in result(host, created)  # polled at the host, which ran it
    r = fwd(host, mid, 1)  # the host adopted the model and its session
    assert r.status_code == 200, r.text
    first = result(front, r.json()["request_id"])
    assert "error" not in first, first
    step = ok(
        front, "optim_step", {"model_id": mid, "seq_id": 2, "adam_params": {"learning_rate": 0.05}}
    )
    assert "error" not in result(front, step["request_id"])
    again = fwd(front, mid, 3).json()["request_id"]
    assert "error" not in result(host, again)
    # a resubmission at the other process is the same future (its dedup key is in the row)
    body = {"model_id": mid, "seq_id": 2, "adam_params": {"learning_rate": 0.05}}
    assert ok(host, "optim_step", body)["request_id"] == step["request_id"]
    assert fwd(front, mid, 1).json()["request_id"] == r.json()["request_id"]


def test_a_sampler_of_a_checkpoint_made_at_the_frontend_samples_everywhere(pair):
    host, front, _, _ = pair
    sid = session(front)
    mid, created = model(front, sid)
    result(front, created)
    saved = ok(front, "save_weights_for_sampler", {"model_id": mid, "seq_id": 1, "path": "s1"})
    path = result(front, saved["request_id"])["path"]
    body = {"session_id": sid, "sampling_session_seq_id": 0, "model_path": path}
    sampler = ok(front, "create_sampling_session", body)["sampling_session_id"]  # a control call
    ask = {
        "sampling_session_id": sampler,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": 3, "seed": 1, "temperature": 1.0},
    }
    at_host = result(front, ok(host, "asample", ask)["request_id"])
    at_front = result(host, ok(front, "asample", ask)["request_id"])
    assert at_host["sequences"][0]["tokens"] == at_front["sequences"][0]["tokens"]
    # a checkpoint whose files are gone fails to load at the host; the frontend answers
    # with that error, as a lone server would
    saved = ok(front, "save_weights_for_sampler", {"model_id": mid, "seq_id": 2, "path": "s2"})
    path = result(front, saved["request_id"])["path"]
    folder = host.app.state.server.store.get(CheckpointRow, path).dir
    shutil.rmtree(folder)
    body = {"session_id": sid, "sampling_session_seq_id": 1, "model_path": path}
    r = post(front, "create_sampling_session", body)
    assert r.status_code >= 400 and r.json()["error"], r.text


def adapter_tar(folder: Path, broken: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            data = (folder / name).read_bytes()
            if broken and name.endswith(".safetensors"):
                data = data[: len(data) // 2]
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_an_import_at_the_frontend_is_checked_by_the_host(pair):
    host, front, _, _ = pair
    mid, created = model(front, session(front))
    result(front, created)
    saved = ok(front, "save_weights_for_sampler", {"model_id": mid, "seq_id": 1, "path": "x"})
    path = result(front, saved["request_id"])["path"]
    folder = Path(host.app.state.server.store.get(CheckpointRow, path).dir)
    url = "/api/v1/treadle/checkpoints/groups/imported/import"
    r = front.post(url, content=adapter_tar(folder), params={"base_model": TINY})
    assert r.status_code == 200, r.text  # the dry run loaded it at the host
    r = front.post(url, content=adapter_tar(folder, broken=True), params={"base_model": TINY})
    assert r.status_code == 400 and "loadable" in r.json()["error"], r.text


def test_a_session_ended_at_the_frontend_is_freed_at_the_host(pair):
    host, front, _, _ = pair
    sid = session(host)
    mid, created = model(host, sid)
    result(host, created)
    ok(front, "session_heartbeat", {"session_id": sid})  # adopted there
    assert ok(front, f"sessions/{sid}/finish", {}) == {}
    eventually(lambda: not host_engine(host).has_model(mid))
    r = fwd(host, mid, 1)
    assert r.status_code == 410 and "finished" in r.json()["error"], r.text

    # an explicit unload at the frontend frees the adapter at the host too
    mid2, created = model(front, session(front))
    result(host, created)
    assert host_engine(host).has_model(mid2)
    assert "error" not in result(front, ok(front, "unload_model", {"model_id": mid2})["request_id"])
    eventually(lambda: not host_engine(host).has_model(mid2))
    assert fwd(host, mid2, 1).status_code == 404


def test_the_openai_routes_of_a_frontend_sample_at_the_host(pair):
    openai = pytest.importorskip("openai")
    host, front, _, _ = pair
    clients = [
        openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c, max_retries=0)
        for c in (host, front)
    ]
    answers = [
        c.completions.create(model=TINY, prompt=[5, 6, 7], max_tokens=4, seed=2, logprobs=2)
        for c in clients
    ]
    assert answers[0].choices[0].text == answers[1].choices[0].text
    assert answers[0].choices[0].logprobs.token_logprobs == pytest.approx(
        answers[1].choices[0].logprobs.token_logprobs, abs=1e-5
    )


def test_notifications_missed_while_listeners_reconnect_are_caught_up(pair):
    host, front, url, _ = pair
    mid, created = model(front, session(front))
    result(front, created)
    with psycopg.connect(url, autocommit=True) as conn:  # cut every listening connection
        cut = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN %'"
        ).fetchall()
    assert len(cut) >= 2
    r = fwd(front, mid, 1)  # its notification may reach nobody
    assert r.status_code == 200, r.text
    assert "error" not in result(front, r.json()["request_id"], timeout=30)


def test_a_second_engine_host_is_refused(pair):
    _, _, _, common = pair
    with pytest.raises(RuntimeError, match="another engine host"):
        with TestClient(create_app(ServerConfig(**common))):
            pass


def test_a_frontend_needs_postgresql(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="engine_host false"):
        ServerConfig(models={TINY: str(tiny_model_dir)}, data_dir=str(tmp_path), engine_host=False)


def test_progress_notifications_fit_and_keep_their_order():
    """A stream's tokens as notification bodies: none near PostgreSQL's payload limit, no
    spaces (the bodies are joined by them), read back in order, -inf logprobs included."""
    from treadle.server.runtime.ops import Progress
    from treadle.server.storage.notify import MAX_PAYLOAD, decode_progress, encode_progress

    tokens = [(i % 8, i // 8, 1000 + i, -float(i) / 7) for i in range(1000)]
    tokens[3] = (3, 0, 7, float("-inf"))
    items = [Progress("r1", tokens), Progress("r2", tokens[:5])]
    bodies = encode_progress(items)
    assert all(len(b) < MAX_PAYLOAD and " " not in b for b in bodies)
    back = decode_progress(" ".join(bodies))
    assert [p.request_id for p in back] == ["r1"] * 5 + ["r2"]
    assert [t for p in back if p.request_id == "r1" for t in p.tokens] == tokens
    assert back[-1].tokens == tokens[:5]
