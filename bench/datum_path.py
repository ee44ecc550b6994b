"""Where a forward_backward's time goes between a training loop's datums and the engine, for
datums built from Python lists and from numpy arrays, through both SDKs.

    python bench/datum_path.py                # CE forward_backward of 8 x 128 tokens on
                                              # bench/grpo_step.py's model
    python bench/datum_path.py --calls 10     # a quick look

The user's data is the same either way: the rows of a CE batch, held as Python lists
(`ModelInput.from_ints(toks)`, `"target_tokens": toks[1:]`, `"weights": [1.0] * n`) or as
numpy arrays (`"target_tokens": row[1:]`, `"weights": np.ones(n, np.float32)`). Stages:
- client, in this process (median µs over --reps): `build` the datums from the user's data,
  `chunk` (the SDK's size estimate and split), `encode` the protobuf body;
- server, in this process, with the functions the API runs: `parse` the protobuf,
  `arrays` (read into numpy, sizes checked), `validate` (ids within the vocabulary, lengths,
  loss inputs), `tensors` (the rows padded into (B, T) arrays and handed to torch, as the
  engine does before its model call);
- a real server on loopback (median ms of --calls calls per SDK and style, the two styles of
  one SDK alternating call by call, each its own training client): `to filed` (from the
  start of the build to the request filed in the API: the client stages, the upload, the
  server's decode and checks), `queued` (filed to the engine's start), `engine` (the
  engine's own run, from the console's request timeline), `back` (to the caller holding
  the decoded result), `round trip`, and `outside` (the round trip less the engine's run:
  all that a datum's style could change).
Also: whether the four bodies are the same bytes (they must be), and a bare healthz round
trip. Goal: lists cost what numpy costs, within noise. Ends with one JSON line.
"""

from __future__ import annotations

import os

from treadle.server.main import OPENMP_SPIN_COUNT

if "OMP_WAIT_POLICY" not in os.environ:  # before torch loads: as `treadle serve` sets it
    os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import tinker  # noqa: E402
import torch  # noqa: E402
from grpo_step import API_KEY, NAME, SHAPE, build_model  # noqa: E402
from tinker.lib.public_interfaces.training_client import (  # noqa: E402
    _estimate_datum_bytes_count_proto,
)
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

import treadle  # noqa: E402
from treadle.client.chunks import split_chunks  # noqa: E402
from treadle.launch import ServerProcess  # noqa: E402
from treadle.protocol.facts import EngineFacts  # noqa: E402
from treadle.server.core import validation  # noqa: E402
from treadle.wire import codec  # noqa: E402

SDKS = ("tinker", "treadle")
STYLES = ("lists", "numpy")
CLIENT_STAGES = ("build", "chunk", "encode")
SERVER_STAGES = ("parse", "arrays", "validate", "tensors")
CALL_STAGES = ("to_filed", "queued", "engine", "back", "round_trip", "outside")


def build(sdk: str, style: str, rows_B_T: np.ndarray | list) -> list:
    """The datums of one CE batch, as a user's loop writes them."""
    T = tinker.types if sdk == "tinker" else treadle
    if style == "lists":
        return [
            T.Datum(
                model_input=T.ModelInput.from_ints(row[:-1]),
                loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * (len(row) - 1)},
            )
            for row in rows_B_T
        ]
    return [
        T.Datum(
            model_input=T.ModelInput.from_ints(row[:-1].tolist()),
            loss_fn_inputs={"target_tokens": row[1:], "weights": np.ones(len(row) - 1, np.float32)},
        )
        for row in rows_B_T
    ]


def chunk(sdk: str, data: list) -> list[list]:
    """The SDK's split into requests (one here), with its per-datum size estimate."""
    if sdk == "treadle":
        return split_chunks(data)
    sizes = [_estimate_datum_bytes_count_proto(d) for d in data]
    assert sum(sizes) < 5_000_000 and len(data) <= 1024  # one chunk: the tinker defaults
    return [data]


def encode(sdk: str, data: list) -> bytes:
    if sdk == "treadle":
        return codec.encode_forward_backward_request("m", 1, data, "cross_entropy", {}, False)
    T = tinker.types
    request = T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id="m",
        seq_id=1,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def to_tensors(data: list) -> tuple[torch.Tensor, ...]:
    """The rows padded into (B, T) arrays and handed to torch, as the engine does."""
    lengths = [len(d.tokens) for d in data]
    B, T = len(lengths), max(lengths)
    ids = np.zeros((B, T), np.int64)  # (B, T)
    targets = np.zeros((B, T), np.int64)  # (B, T)
    weights = np.zeros((B, T), np.float32)  # (B, T)
    for i, d in enumerate(data):
        ids[i, : lengths[i]] = d.tokens
        targets[i, : lengths[i]] = d.loss_inputs["target_tokens"]
        weights[i, : lengths[i]] = d.loss_inputs["weights"]
    return torch.from_numpy(ids), torch.from_numpy(targets), torch.from_numpy(weights)


def median_us(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def local_stages(rows: dict[str, object], facts: EngineFacts, reps: int) -> dict:
    """Client and server stages of each SDK and style, in this process (µs), and the
    bodies."""
    out: dict = {}
    for sdk in SDKS:
        for style in STYLES:
            data = build(sdk, style, rows[style])
            body = encode(sdk, data)
            msg = codec.parse_forward_backward_request(body)
            arrays = codec.forward_backward_arrays(msg, 1 << 24)
            payload = validation.train_data(arrays, facts)
            out[(sdk, style)] = {
                "body": body,
                "build": median_us(lambda s=sdk, st=style: build(s, st, rows[st]), reps),
                "chunk": median_us(lambda s=sdk, d=data: chunk(s, d), reps),
                "encode": median_us(lambda s=sdk, d=data: encode(s, d), reps),
                "parse": median_us(lambda b=body: codec.parse_forward_backward_request(b), reps),
                "arrays": median_us(lambda m=msg: codec.forward_backward_arrays(m, 1 << 24), reps),
                "validate": median_us(lambda a=arrays: validation.train_data(a, facts), reps),
                "tensors": median_us(lambda p=payload: to_tensors(p.data), reps),
            }
    return out


def server_ops(transport, session_id: str, model_id: str, spans: list) -> list[dict]:
    """The model's forward_backward op filed within each (start, end) span of the client,
    from the console's request timeline (the server records them in the background: wait
    for them)."""
    path = f"/api/v1/treadle/console/sessions/{session_id}/timeline?limit=5000"
    deadline = time.monotonic() + 30
    while True:
        ops = transport.call(transport.get(path))["ops"]
        ops = [o for o in ops if o["model_id"] == model_id and o["kind"] == "forward_backward"]
        found = [[o for o in ops if t0 <= o["queued_at"] <= t1] for t0, t1 in spans]
        if all(len(f) == 1 for f in found):
            return [f[0] for f in found]
        if time.monotonic() > deadline:
            raise RuntimeError(f"the timeline lacks ops of {model_id} ({len(ops)} found)")
        time.sleep(0.2)


def calls(url: str, rows: dict[str, object], n: int) -> dict:
    """Round trips through a real server (ms), per SDK and style, and their stages."""
    probe = treadle.ServiceClient(base_url=url, api_key=API_KEY)  # reads the timelines
    out: dict = {}
    for sdk in SDKS:
        if sdk == "tinker":
            svc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
            clients = {
                s: svc.create_lora_training_client(base_model=NAME, rank=8).result() for s in STYLES
            }
            session_id = svc.holder.get_session_id()
        else:
            svc = treadle.ServiceClient(base_url=url, api_key=API_KEY)
            clients = {s: svc.create_lora_training_client(NAME, rank=8) for s in STYLES}
            session_id = svc.session_id
        spans: dict[str, list[tuple[float, float]]] = {s: [] for s in STYLES}
        for style, tc in clients.items():  # warm-up
            tc.forward_backward(build(sdk, style, rows[style]), "cross_entropy").result()
        for i in range(n):
            for style in STYLES if i % 2 == 0 else STYLES[::-1]:
                tc = clients[style]
                t0 = time.time()
                tc.forward_backward(build(sdk, style, rows[style]), "cross_entropy").result()
                spans[style].append((t0, time.time()))
        for style, tc in clients.items():
            ops = server_ops(probe.transport, session_id, tc.model_id, spans[style])
            stages = [
                {
                    "to_filed": o["queued_at"] - t0,
                    "queued": o["started_at"] - o["queued_at"],
                    "engine": o["finished_at"] - o["started_at"],
                    "back": t1 - o["finished_at"],
                    "round_trip": t1 - t0,
                    "outside": t1 - t0 - (o["finished_at"] - o["started_at"]),
                }
                for o, (t0, t1) in zip(ops, spans[style], strict=True)
            ]
            out[(sdk, style)] = {
                k: 1e3 * statistics.median(s[k] for s in stages) for k in CALL_STAGES
            }
        svc.close() if sdk == "treadle" else svc.close("success")
    health = []
    for _ in range(20):
        t0 = time.perf_counter()
        probe.transport.call(probe.transport.get("/api/v1/healthz"))
        health.append(time.perf_counter() - t0)
    out["healthz_ms"] = 1e3 * statistics.median(health)
    probe.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--len", type=int, default=128, help="tokens per row")
    ap.add_argument("--calls", type=int, default=30, help="calls per SDK and style")
    ap.add_argument("--reps", type=int, default=300, help="repeats of each local stage")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model")  # bench/grpo_step.py's 5.2M Qwen3
        vocab = SHAPE["vocab_size"]
        array = np.random.default_rng(0).integers(3, vocab, (args.rows, args.len + 1))
        rows = {"lists": array.tolist(), "numpy": array}
        facts = EngineFacts(NAME, vocab, 4096, 64)
        local = local_stages(rows, facts, args.reps)
        with ServerProcess({NAME: model_dir}, Path(tmp) / "data") as server:
            remote = calls(server.url, rows, args.calls)
    bodies = {local[k]["body"] for k in local}
    result: dict = {"bench": "datum_path", "same_bytes": len(bodies) == 1}
    cols = [(sdk, style) for sdk in SDKS for style in STYLES]
    print(f"CE forward_backward of {args.rows} x {args.len} tokens; body {len(bodies.pop())} bytes")
    print(f"{'stage':12s} " + " ".join(f"{sdk + ' ' + style:>15s}" for sdk, style in cols))
    for stage in CLIENT_STAGES + SERVER_STAGES:
        print(f"{stage + ' µs':12s} " + " ".join(f"{local[c][stage]:15.1f}" for c in cols))
        result |= {f"{c[0]}_{c[1]}_{stage}_us": round(local[c][stage], 1) for c in cols}
    for stage in CALL_STAGES:
        print(f"{stage + ' ms':12s} " + " ".join(f"{remote[c][stage]:15.2f}" for c in cols))
        result |= {f"{c[0]}_{c[1]}_{stage}_ms": round(remote[c][stage], 2) for c in cols}
    for sdk in SDKS:
        lists, numpy = remote[(sdk, "lists")], remote[(sdk, "numpy")]
        ratio = lists["round_trip"] / numpy["round_trip"]
        extra = lists["outside"] - numpy["outside"]
        result[f"{sdk}_lists_over_numpy"] = round(ratio, 3)
        result[f"{sdk}_lists_minus_numpy_outside_ms"] = round(extra, 2)
        print(
            f"{sdk}: round trip lists / numpy {ratio:.3f} (goal: 1 within noise); outside the "
            f"engine, lists - numpy {extra:+.2f} ms"
        )
    result["healthz_ms"] = round(remote["healthz_ms"], 2)
    print(
        f"same bytes from every SDK and style: {result['same_bytes']}; healthz {result['healthz_ms']} ms"
    )
    print(json.dumps(result | vars(args)))


if __name__ == "__main__":
    main()
