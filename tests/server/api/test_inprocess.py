"""The app in-process (create_app + TestClient, a real engine on the tiny model, a temporary
SQLite database): handlers, validation and limits without paying for a server process.

    .venv/bin/python -m pytest -q tests/server/api/test_inprocess.py
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from treadle.errors import NotFoundError, QuotaExceededError
from treadle.server.app import create_app, default_engine_factory
from treadle.server.config import ServerConfig
from treadle.types import Datum, ModelInput, TensorData
from treadle.wire import codec

TINY = "treadle/tiny-llama"
# Prompts that start with these tokens make the engine itself raise (see faulty_engine).
GONE, BUSY = [490, 491], [490, 492]


def faulty_engine(name: str, path: str, config: ServerConfig):
    """The real engine, except that two marked prompts fail inside its sampler (when they
    join the decode batch), as a sampler whose weights were freed or an engine-side quota
    would: errors raised in the engine, not at the edge."""
    engine = default_engine_factory(name, path, config)
    sample, decode_batch = engine.sample, engine.decode_batch

    def check(requests):
        for r in requests:
            if r.prompt[:2] == GONE:
                raise NotFoundError("the sampler's weights went away mid-request")
            if r.prompt[:2] == BUSY:
                raise QuotaExceededError("this engine takes no more work from you today")

    def faulty(requests):
        check(requests)
        return sample(requests)

    def faulty_batch():  # the incremental sampler the engine loop uses
        batch = decode_batch()
        add = batch.add

        def faulty_add(requests, stream=None):
            check(requests)
            return add(requests, stream)

        batch.add = faulty_add
        return batch

    engine.sample, engine.decode_batch = faulty, faulty_batch
    return engine


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("inprocess")
    config = ServerConfig(
        models={TINY: str(tiny_model_dir)}, data_dir=str(data), engine_processes=False
    )
    with TestClient(create_app(config, engine_factory=faulty_engine)) as c:
        yield c


def post(client: TestClient, path: str, body=None, **kw):
    return client.post(f"/api/v1/{path}", json=body, **kw)


def result(client: TestClient, request_id: str) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = post(client, "retrieve_future", {"request_id": request_id})
        assert r.status_code == 200, r.text
        if r.json().get("type") != "try_again":
            return r.json()
    raise TimeoutError(request_id)


def new_model(client: TestClient, rank: int = 4) -> str:
    sid = post(client, "create_session", {"tags": [], "sdk_version": "t"}).json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": rank}}
    reply = post(client, "create_model", body)
    assert reply.status_code == 200, reply.text
    assert "error" not in result(client, reply.json()["request_id"])
    return reply.json()["model_id"]


def fwd(client: TestClient, model_id: str, seq_id: int, inputs: dict, loss="cross_entropy"):
    T = len(inputs["target_tokens"])
    datum = Datum(
        model_input=ModelInput.from_ints(list(range(1, T + 1))),
        loss_fn_inputs={k: TensorData.from_numpy(np.asarray(v)) for k, v in inputs.items()},
    )
    body = codec.encode_forward_backward_request(model_id, seq_id, [datum], loss, None, False)
    return client.post("/api/v1/forward_backward", content=body)


def test_a_cross_entropy_datum_without_weights_is_a_400_naming_the_field(client):
    model = new_model(client)
    r = fwd(client, model, 1, {"target_tokens": np.array([2, 3, 4])})
    assert r.status_code == 400, r.text
    assert "'weights'" in r.json()["error"] and "cross_entropy" in r.json()["error"]
    # the refusal used up seq 1: the session goes on at seq 2
    ok = fwd(client, model, 2, {"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3)})
    assert ok.status_code == 200, ok.text
    assert "error" not in result(client, ok.json()["request_id"])


def test_values_that_cannot_be_meant_are_refused_at_the_edge(client):
    model = new_model(client)
    huge = {"target_tokens": np.array([2, 3]), "weights": np.array([1e38, 1.0], np.float32)}
    r = fwd(client, model, 1, huge)
    assert r.status_code == 400 and "['weights']" in r.json()["error"], r.text
    nan = {"target_tokens": np.array([2, 3]), "weights": np.array([np.nan, 1.0], np.float32)}
    r = fwd(client, model, 2, nan)
    assert r.status_code == 400 and "finite" in r.json()["error"], r.text
    adam = {"learning_rate": 1e30, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    r = post(client, "optim_step", {"model_id": model, "seq_id": 3, "adam_params": adam})
    assert r.status_code == 400 and "adam_params.learning_rate" in r.json()["error"], r.text
    sid = post(client, "create_session", {"tags": []}).json()["session_id"]
    body = {
        "session_id": sid,
        "model_seq_id": 0,
        "base_model": TINY,
        "lora_config": {"rank": 2**31},
    }
    r = post(client, "create_model", body)  # refused before any allocation
    assert r.status_code == 400 and "lora_config.rank" in r.json()["error"], r.text


def test_engine_errors_reach_openai_clients_with_their_own_status(client):
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0
    )
    ok = oa.completions.create(model=TINY, prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert len(ok.choices) == 1
    # Neither message says "not found" or "quota": the status comes from the error's class.
    with pytest.raises(openai.NotFoundError, match="went away"):
        oa.completions.create(model=TINY, prompt=[*GONE, 5], max_tokens=2)
    with pytest.raises(openai.RateLimitError, match="no more work"):
        oa.completions.create(model=TINY, prompt=[*BUSY, 5], max_tokens=2)
    # an unknown model is a 404 with OpenAI's code
    with pytest.raises(openai.NotFoundError) as missing:
        oa.chat.completions.create(
            model="no/such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert missing.value.body["code"] == "model_not_found"
