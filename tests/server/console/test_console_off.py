"""A server with the console off (`--console false`), in-process: no console routes, pages,
static files or recorder, and everything else works: training and sampling, the loop's own
metrics (TrainingClient.log_metrics), and spend caps, whose counting needs no console.

    .venv/bin/python -m pytest -q tests/server/console/test_console_off.py
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from treadle.server.app import create_app
from treadle.server.config import ServerConfig
from treadle.server.storage.database import Store
from treadle.server.storage.rows import OpRecordRow, RequestRow, StepFigureRow
from treadle.server.tenancy import spend, tenants
from treadle.types import Datum, ModelInput, TensorData
from treadle.wire import codec

TINY = "treadle/tiny-llama"


@pytest.fixture
def server(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(spend, "CAP_RELOAD_S", 0.0)  # a cap set below applies at once
    db = Store(f"sqlite:///{tmp_path / 'treadle.db'}")
    tenants.create_tenant(db, "acme")
    key, _ = tenants.create_key(db, "acme")
    config = ServerConfig(
        models={TINY: str(tiny_model_dir)},
        data_dir=str(tmp_path),
        engine_processes=False,
        console=False,
    )
    app = create_app(config)
    with TestClient(app, headers={"X-API-Key": key}) as client:
        yield app, client, db
    db.close()


def post(client: TestClient, path: str, body=None, **kw):
    return client.post(f"/api/v1/{path}", json=body, **kw)


def done(client: TestClient, request_id: str) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = post(client, "retrieve_future", {"request_id": request_id})
        assert r.status_code == 200, r.text
        if r.json().get("type") != "try_again":
            assert "error" not in r.json(), r.json()
            return r.json()
    raise TimeoutError(request_id)


def forward_backward(client: TestClient, model_id: str, seq_id: int):
    datum = Datum(
        model_input=ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(np.array([2, 3, 4, 5])),
            "weights": TensorData.from_numpy(np.ones(4, np.float32)),
        },
    )
    body = codec.encode_forward_backward_request(
        model_id, seq_id, [datum], "cross_entropy", None, False
    )
    return client.post("/api/v1/forward_backward", content=body)


def test_no_console_and_everything_else_works(server):
    app, client, db = server
    # no console: its pages, its JSON, its login and static files are not there
    for path in (
        "/console",
        "/console/sessions",
        "/console/login",
        "/console/static/console.css",
        "/console/static/vendor/htmx.min.js",
        "/api/v1/treadle/console/overview",
    ):
        assert client.get(path).status_code == 404, path
    assert not hasattr(app.state, "console")
    assert not [t for t in threading.enumerate() if t.name == "console-recorder"]

    # training, sampling and the loop's own metrics work
    sid = post(client, "create_session", {"tags": []}).json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": 4}}
    model = post(client, "create_model", body).json()
    done(client, model["request_id"])
    model_id = model["model_id"]
    done(client, forward_backward(client, model_id, 1).json()["request_id"])
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    step = post(client, "optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": adam})
    done(client, step.json()["request_id"])
    completion = client.post(
        "/v1/completions", json={"model": TINY, "prompt": [5, 6, 7], "max_tokens": 2}
    )
    assert completion.status_code == 200, completion.text
    logged = post(
        client, "treadle/metrics", {"model_id": model_id, "step": 1, "metrics": {"reward": 0.5}}
    )
    assert logged.status_code == 200 and logged.json()["recorded"] == 1, logged.text

    # spend was counted without the console: a cap below it refuses the next metered call
    spend.set_cap(db, "acme", "day", max_tokens=1)
    refused = forward_backward(client, model_id, 3)
    assert refused.status_code == 429 and "spend cap" in refused.json()["error"], refused.text

    # nothing recorded for the console; the loop's figures and the requests' keys are kept
    assert db.query(select(OpRecordRow)) == []
    figures = db.query(select(StepFigureRow))
    assert [(f.name, f.value, f.source) for f in figures] == [("reward", 0.5, "user")]
    metered = [r for r in db.query(select(RequestRow)) if r.kind == "forward_backward"]
    assert metered and all(r.key_id is not None for r in metered)
