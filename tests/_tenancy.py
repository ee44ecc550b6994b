"""Helpers of the tenant, quota and metering tests: tenants and keys made in a server's
database before it starts, and raw HTTP calls of one tenant."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _inproc import InProcessServer

from treadle.launch import ServerProcess
from treadle.server.storage.database import Store
from treadle.server.tenancy import tenants
from treadle.types import Datum, ModelInput, TensorData
from treadle.wire import codec

TINY = "treadle/tiny-llama"
WAIT_S = 120.0  # any one result, on a busy 2-core machine


def make_tenants(data_dir: Path, quotas: dict[str, dict | None]) -> dict[str, str]:
    """Tenants (name → quotas) in the database of a server on data_dir; → name → key."""
    data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(f"sqlite:///{data_dir.resolve() / 'treadle.db'}")
    try:
        keys = {}
        for name, q in quotas.items():
            tenants.create_tenant(store, name, q)
            keys[name], _ = tenants.create_key(store, name)
        return keys
    finally:
        store.close()


def start_server(
    models: dict[str, Path], data_dir: Path, config: dict | None, process: bool = False
) -> ServerProcess | InProcessServer:
    """A real server on a free port: in this process (tests/_inproc.py), or a `treadle
    serve` process where the test needs one (its memory, a kill)."""
    if process:
        return ServerProcess(models, data_dir, config=config, startup_timeout_s=180).start()
    return InProcessServer(models, data_dir, config=config, startup_timeout_s=180).start()


class Api:
    """Raw calls of one tenant (its key in X-API-Key, or none)."""

    def __init__(self, url: str, key: str | None, bearer: bool = False):
        headers = {}
        if key is not None:
            headers = {"Authorization": f"Bearer {key}"} if bearer else {"X-API-Key": key}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=WAIT_S)

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return self.http.post(f"/api/v1/{path}", json=body, **kw)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.http.get(f"/api/v1/{path}", **kw)

    def ok(self, path: str, body: Any = None) -> dict:
        resp = self.post(path, body)
        assert resp.status_code == 200, (path, resp.status_code, resp.text)
        return resp.json()

    def result(self, request_id: str, proto: bool = False) -> httpx.Response:
        """The finished future's response (the long-poll repeated until it is not try_again)."""
        headers = {"Accept": "application/x-protobuf"} if proto else {}
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            resp = self.post("retrieve_future", {"request_id": request_id}, headers=headers)
            if resp.headers.get("content-type", "").startswith("application/json"):
                if resp.status_code == 200 and resp.json().get("type") == "try_again":
                    continue
                assert not proto or resp.status_code != 200, f"not a protobuf: {resp.text}"
            return resp
        raise TimeoutError(request_id)

    def done(self, request_id: str) -> dict:
        resp = self.result(request_id)
        assert resp.status_code == 200 and "error" not in resp.json(), resp.text
        return resp.json()

    def session(self) -> str:
        return self.ok("create_session", {"tags": [], "sdk_version": "0.38.0"})["session_id"]

    def model(self, session_id: str, seq: int = 0, rank: int = 4) -> str:
        body = {
            "session_id": session_id,
            "model_seq_id": seq,
            "base_model": TINY,
            "lora_config": {"rank": rank},
        }
        reply = self.ok("create_model", body)
        self.done(reply["request_id"])
        return reply["model_id"]

    def sampler(self, session_id: str, seq: int = 0, **source: str) -> str:
        """A sampling session of the base model (or of `model_path=...`)."""
        body = {"session_id": session_id, "sampling_session_seq_id": seq}
        body.update(source or {"base_model": TINY})
        return self.ok("create_sampling_session", body)["sampling_session_id"]

    def forward(
        self, model_id: str, seq_id: int, lengths: list[int], backward: bool = False
    ) -> httpx.Response:
        body = fb_body(model_id, seq_id, lengths, forward_only=not backward)
        return self.http.post("/api/v1/forward_backward", content=body)

    def close(self) -> None:
        self.http.close()


def token_data(lengths: list[int], seed: int = 0, vocab: int = 200) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for T in lengths:
        seq = rng.integers(0, vocab, T + 1)
        data.append(
            Datum(
                model_input=ModelInput.from_ints(seq[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": TensorData.from_numpy(seq[1:].astype(np.int64)),
                    "weights": TensorData.from_numpy(np.ones(T, dtype=np.float32)),
                },
            )
        )
    return data


def fb_body(model_id: str, seq_id: int, lengths: list[int], forward_only: bool = True) -> bytes:
    data = token_data(lengths, seed=seq_id)
    return codec.encode_forward_backward_request(
        model_id, seq_id, data, "cross_entropy", None, forward_only
    )
