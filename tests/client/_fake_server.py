"""A protocol-level stand-in server for unit tests of the SDK's own logic.

It speaks the Tinker wire protocol (JSON + protobuf) but computes nothing real: a
forward_backward's "logprobs" are `-(target_token % 7) / 10`, so results are checkable.
What it does keep is what the SDK's logic is tested against: per-model execution strictly in
seq_id order (waiting for gaps), de-duplication of re-sent submits, long-polls answered with
try_again, and a log of every POST in arrival order. Real behaviour is tested against the
real server elsewhere in this folder.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from treadle.types import ForwardBackwardOutput, SampledSequence, SampleResponse, TensorData
from treadle.wire import codec

PROTOBUF = "application/x-protobuf"


def fake_logprobs(targets: np.ndarray) -> np.ndarray:
    return -(targets % 7).astype(np.float32) / 10


@dataclass
class FakeState:
    arrivals: list[tuple[str, int | None, float]] = field(default_factory=list)
    executed: list[tuple[str, int]] = field(default_factory=list)  # (model_id, seq_id)
    requests: dict[str, dict] = field(default_factory=dict)  # request_id → entry
    by_key: dict[tuple[str, int], str] = field(default_factory=dict)
    fail_next: dict[str, int] = field(default_factory=dict)  # path → 503s left
    client_config: dict[str, Any] = field(default_factory=dict)
    exec_delay_s: float = 0.0
    sample_barrier: int = 0  # hold sample results until this many samples have arrived
    poll_hold_s: float = 0.2
    n_samples: int = 0


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()
    cond = asyncio.Condition()
    models: dict[str, int] = {}  # model_id → last executed seq_id

    async def notify() -> None:
        async with cond:
            cond.notify_all()

    def arrive(path: str, seq_id: int | None) -> Response | None:
        state.arrivals.append((path, seq_id, time.monotonic()))
        if state.fail_next.get(path, 0) > 0:
            state.fail_next[path] -= 1
            return JSONResponse({"detail": "transient"}, status_code=503)
        return None

    def submit(key: tuple[str, int], entry: dict) -> dict:
        if key in state.by_key:  # a retried submit: the request we already have
            return {"request_id": state.by_key[key]}
        rid = f"r{len(state.requests)}"
        state.by_key[key] = rid
        state.requests[rid] = {**entry, "key": key, "done": None}
        asyncio.get_running_loop().create_task(run_ready())
        return {"request_id": rid}

    async def run_ready() -> None:
        progressed = True
        while progressed:
            progressed = False
            for entry in list(state.requests.values()):
                model_id, seq = entry["key"]
                if entry["done"] is not None or entry.get("running"):
                    continue
                if entry["kind"] == "train" and models.get(model_id, 0) != seq - 1:
                    continue  # wait for the gap to fill
                if entry["kind"] == "sample" and state.n_samples < state.sample_barrier:
                    continue
                entry["running"] = True
                if state.exec_delay_s:
                    await asyncio.sleep(state.exec_delay_s)
                entry["done"] = entry["run"]()
                if entry["kind"] == "train":
                    models[model_id] = seq
                    state.executed.append((model_id, seq))
                progressed = True
        await notify()

    @app.post("/api/v1/client/config")
    async def client_config() -> dict:
        return state.client_config

    @app.post("/api/v1/create_session")
    async def create_session() -> dict:
        return {"session_id": "sess"}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat() -> dict:
        arrive("session_heartbeat", None)
        return {}

    @app.post("/api/v1/sessions/{sid}/finish")
    async def finish(sid: str) -> dict:
        arrive("finish", None)
        return {}

    @app.post("/api/v1/create_model")
    async def create_model(req: Request) -> Any:
        body = await req.json()
        model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
        models[model_id] = 0
        entry = {"kind": "create", "run": lambda: {"model_id": model_id}}
        return submit((body["session_id"], -1 - body["model_seq_id"]), entry)

    @app.post("/api/v1/get_info")
    async def get_info(req: Request) -> dict:
        body = await req.json()
        return {"model_id": body["model_id"], "model_data": {"model_name": "fake/model"}}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(req: Request) -> Any:
        model_id, seq_id, data, loss_fn, config, fwd_only = codec.decode_forward_backward_request(
            await req.body()
        )
        if (fail := arrive("forward_backward", seq_id)) is not None:
            return fail

        def run() -> bytes:
            outs, loss = [], 0.0
            for d in data:
                lp = fake_logprobs(d.loss_fn_inputs["target_tokens"].to_numpy())
                w = d.loss_fn_inputs["weights"].to_numpy()
                loss += float(-(lp * w).sum())
                outs.append({"logprobs": TensorData.from_numpy(lp)})
            out = ForwardBackwardOutput(
                loss_fn_outputs=outs, metrics={"loss:sum": loss, "seq:mean": float(seq_id)}
            )
            return codec.encode_forward_backward_output(out)

        return submit((model_id, seq_id), {"kind": "train", "run": run, "weights": data})

    @app.post("/api/v1/optim_step")
    async def optim_step(req: Request) -> Any:
        body = await req.json()
        if (fail := arrive("optim_step", body["seq_id"])) is not None:
            return fail
        entry = {"kind": "train", "run": lambda: {"metrics": {"step:max": 1.0}}}
        return submit((body["model_id"], body["seq_id"]), entry)

    @app.post("/api/v1/save_weights")
    async def save_weights(req: Request) -> Any:
        body = await req.json()
        arrive("save_weights", body["seq_id"])
        entry = {"kind": "train", "run": lambda: {"error": "disk full", "category": "server"}}
        reply = submit((body["model_id"], body["seq_id"]), entry)
        if body["path"] == "bad":
            # Rejected, but its seq_id is spent: later ops must not wait for it.
            return JSONResponse({"detail": "path: 'bad' is not allowed"}, status_code=400)
        return reply

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(req: Request) -> dict:
        body = await req.json()
        return {"sampling_session_id": f"samp-{body['sampling_session_seq_id']}"}

    @app.post("/api/v1/asample")
    async def asample(req: Request) -> Any:
        body = await req.json()
        if (fail := arrive("asample", body["seq_id"])) is not None:
            return fail
        state.n_samples += 1
        prompt = [t for c in body["prompt"]["chunks"] for t in c["tokens"]]

        def run() -> bytes:
            seqs = [
                SampledSequence(stop_reason="length", tokens=[*prompt[-1:], i], logprobs=[0.0, 0.0])
                for i in range(body["num_samples"])
            ]
            return codec.encode_sample_response(SampleResponse(sequences=seqs))

        key = (body["sampling_session_id"], body["seq_id"])
        reply = submit(key, {"kind": "sample", "run": run})
        reply["sample_sequence_ids"] = [f"{key}-{i}" for i in range(body["num_samples"])]
        return reply

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(req: Request) -> Any:
        rid = (await req.json())["request_id"]
        entry = state.requests[rid]
        deadline = time.monotonic() + state.poll_hold_s
        async with cond:
            while entry["done"] is None and time.monotonic() < deadline:
                try:
                    await asyncio.wait_for(cond.wait(), deadline - time.monotonic())
                except TimeoutError:
                    break
        done = entry["done"]
        if done is None:
            return {"type": "try_again", "request_id": rid, "queue_state": "active"}
        if isinstance(done, bytes):
            return Response(done, media_type=PROTOBUF)
        return done

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """The app above under uvicorn in a thread, on a free port."""

    def __init__(self) -> None:
        self.state = FakeState()
        self.port = free_port()
        config = uvicorn.Config(
            make_app(self.state), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
