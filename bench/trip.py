"""The trip of one call: which source files of Treadle one `forward_backward` runs through,
from the HTTP request to the poll that returns its result, in both processes.

    .venv/bin/python bench/trip.py               # the list, grouped by package, and one JSON line
    .venv/bin/python bench/trip.py --markdown    # the table docs/architecture.md shows
    .venv/bin/python bench/trip.py --functions   # each file's functions that ran, and on which threads

The app runs in this process with its worker on a thread (`--engine-processes false`: the
same Worker code a worker process runs, over an in-process socket), so one profiler sees
both sides. Every thread the app starts is profiled from start-up (not this script's own,
the client's, which builds the body and reads the reply); only the calls made while the
forward_backward is filed, run and polled are counted (a warm-up call first, so that
imports and first-use caches are not), and not the idle-session reaper's timer. A file
counts if any function defined in it runs.
Layers are the packages a file belongs to, in the order the call first reaches them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

SRC = Path(__file__).resolve().parents[1] / "src" / "treadle"
_recording = False
# file → its functions that ran → their threads; files in the order of their first call
_ran: dict[str, dict[str, set[str]]] = {}
# what runs on a timer whatever the calls (the idle-session reaper), not part of the trip
BACKGROUND = frozenset({"_reap_idle_sessions", "expire_idle_sessions"})


def _profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
    if _recording and event == "call" and frame.f_code.co_name not in BACKGROUND:
        name = frame.f_code.co_filename
        if name.startswith(str(SRC)):
            threads = _ran.setdefault(name, {}).setdefault(frame.f_code.co_name, set())
            threads.add(_thread_name(threading.current_thread().name))


def _thread_name(name: str) -> str:
    # the event loop's thread is named by its id (anyio's portal): one name for it
    return "event-loop" if name.startswith("asyncio-portal") else name


def layer_of(path: str) -> str:
    parts = Path(path).relative_to(SRC).parts
    if parts[0] == "server" and len(parts) > 2:
        return f"server/{parts[1]}"
    return parts[0].removesuffix(".py")


def trace_forward_backward() -> list[str]:
    global _recording
    threading.setprofile(_profile)  # the threads the app starts; not this one, the client's
    from fastapi.testclient import TestClient

    from treadle.engine.tiny import make_tiny_model
    from treadle.server.app import create_app
    from treadle.server.config import ServerConfig
    from treadle.types import Datum, ModelInput, TensorData
    from treadle.wire import codec

    name = "treadle/tiny-llama"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny-llama", arch="llama")
        config = ServerConfig(
            models={name: str(model_dir)}, data_dir=str(Path(tmp) / "data"), engine_processes=False
        )
        with TestClient(create_app(config)) as client:

            def post(path: str, body=None, **kw):
                return client.post(f"/api/v1/{path}", json=body, **kw)

            def wait(rid: str) -> dict:
                while True:
                    r = post("retrieve_future", {"request_id": rid})
                    if r.headers.get("content-type", "").startswith("application/x-protobuf"):
                        return {}
                    if r.json().get("type") != "try_again":
                        return r.json()

            sid = post("create_session", {"tags": [], "sdk_version": "trip"}).json()["session_id"]
            body = {"session_id": sid, "model_seq_id": 0, "base_model": name}
            model = post("create_model", {**body, "lora_config": {"rank": 8}}).json()
            wait(model["request_id"])
            tokens = np.arange(1, 65)
            datum = Datum(
                model_input=ModelInput.from_ints(tokens[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": TensorData.from_numpy(tokens[1:]),
                    "weights": TensorData.from_numpy(np.ones(63, np.float32)),
                },
            )

            def forward_backward(seq_id: int) -> None:
                req = codec.encode_forward_backward_request(
                    model["model_id"], seq_id, [datum], "cross_entropy", None, False
                )
                reply = client.post("/api/v1/forward_backward", content=req)
                assert reply.status_code == 200, reply.text
                wait(reply.json()["request_id"])

            forward_backward(1)  # warm-up: imports and first-use caches
            time.sleep(0.5)  # the console recorder's flush of the warm-up
            _recording = True
            forward_backward(2)
            time.sleep(0.5)  # what runs after the result (the recorder's flush)
            _recording = False
    threading.setprofile(None)  # type: ignore[arg-type]
    return list(_ran)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print the table of the docs")
    ap.add_argument("--functions", action="store_true", help="each file's functions and threads")
    args = ap.parse_args()
    files = trace_forward_backward()
    layers: dict[str, list[str]] = {}
    for f in files:
        layers.setdefault(layer_of(f), []).append(str(Path(f).relative_to(SRC)))
    if args.markdown:
        print("| layer | files |\n|---|---|")
        for layer, fs in layers.items():
            print(f"| `{layer}` | {', '.join(f'`{f}`' for f in fs)} |")
    elif args.functions:
        for f in files:
            ran = _ran[f]
            threads = sorted(set().union(*ran.values()))
            print(f"{Path(f).relative_to(SRC)}  [{', '.join(threads)}]: {' '.join(sorted(ran))}")
    else:
        for layer, fs in layers.items():
            print(f"{layer:16s} {len(fs):2d}  {' '.join(fs)}")
    print(json.dumps({"files": len(files), "layers": len(layers), "order": list(layers)}))


if __name__ == "__main__":
    main()
