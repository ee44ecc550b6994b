"""A forward_backward too long for the server's memory budget is refused at the edge, before
anything is queued or allocated, with a 400 naming its length and the limit; the session
goes on (the app in-process, a real engine on the tiny model).

    .venv/bin/python -m pytest -q tests/server/api/test_memory_limit.py
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from fastapi.testclient import TestClient

from treadle.server.app import create_app
from treadle.server.config import ServerConfig

TINY = "treadle/tiny-llama"
LIMIT = 200  # tokens the budget below is sized to hold


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from treadle.engine.memory import ModelShape

    shape = ModelShape.of(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    budget = shape.weight_bytes + shape.activations(LIMIT, checkpointed=True, train=True)
    config = ServerConfig(
        models={TINY: str(tiny_model_dir)},
        data_dir=str(tmp_path_factory.mktemp("memory-limit")),
        engine_processes=False,
        activation_checkpointing="on",
        memory_budget_gb=(budget + 1024) / (1 << 30),
    )
    with TestClient(create_app(config)) as c:
        yield c


def _post(client, path, body):
    return client.post(f"/api/v1/{path}", json=body)


def _result(client, request_id: str) -> dict:
    for _ in range(600):
        r = _post(client, "retrieve_future", {"request_id": request_id})
        if r.json().get("type") != "try_again":
            return r.json()
    raise TimeoutError(request_id)


def _fb(client, model_id: str, seq_id: int, T: int):
    from treadle.types import Datum, ModelInput, TensorData
    from treadle.wire import codec

    datum = Datum(
        model_input=ModelInput.from_ints([1 + t % 400 for t in range(T)]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(np.arange(2, T + 2) % 400),
            "weights": TensorData.from_numpy(np.ones(T, np.float32)),
        },
    )
    body = codec.encode_forward_backward_request(
        model_id, seq_id, [datum], "cross_entropy", None, False
    )
    return client.post("/api/v1/forward_backward", content=body)


def test_an_over_budget_sequence_is_a_400_naming_length_and_limit(client):
    sid = _post(client, "create_session", {"tags": [], "sdk_version": "t"}).json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": 4}}
    reply = _post(client, "create_model", body)
    assert reply.status_code == 200, reply.text
    model = reply.json()["model_id"]
    assert "error" not in _result(client, reply.json()["request_id"])

    r = _fb(client, model, 1, 600)  # within the model's context (1024), not the budget
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "length 600" in error and "model_input" in error
    limit = int(re.search(r"limit of (\d+) tokens", error).group(1))
    assert LIMIT - 5 <= limit <= LIMIT + 5
    assert "activation checkpointing on" in error or "memory budget" in error

    ok = _fb(client, model, 2, limit)  # the refusal used seq 1; the longest that fits runs
    assert ok.status_code == 200, ok.text
    out = _result(client, ok.json()["request_id"])
    assert "error" not in out and np.isfinite(out["metrics"]["loss:sum"])


def test_serve_flags_reach_the_engine_settings(tiny_model_dir):
    """The flags become the worker's settings, and the worker's engine is made with them."""
    import argparse

    from treadle.engine.memory import MemorySettings
    from treadle.server.config import flag_values, serve_flags
    from treadle.server.engines.supervisor import worker_config
    from treadle.worker.process import load_engine

    parser = argparse.ArgumentParser()
    serve_flags(parser)
    args = parser.parse_args(
        ["--activation-checkpointing", "on", "--memory-budget-gb", "2", "--max-context", "4096"]
    )
    config = ServerConfig(models={TINY: str(tiny_model_dir)}, **flag_values(args))
    engine = load_engine(worker_config(config, TINY, str(tiny_model_dir)))
    assert engine.memory_plan.settings == MemorySettings("on", 2 << 30, None)
    assert engine.max_seq_len == 4096
    with pytest.raises(SystemExit):  # argparse refuses a mode it does not know
        parser.parse_args(["--activation-checkpointing", "sometimes"])
    with pytest.raises(ValueError, match="memory_budget_gb"):
        ServerConfig(models={TINY: str(tiny_model_dir)}, memory_budget_gb=0)
