"""`treadle serve --devices 2`: a worker group of 2 gloo ranks behind the real server.

The group keeps one continuous decode batch, as one worker process does: chats stream
through it token by token (two at once: a share on each rank) and add up to the plain
answers, and a forward_backward filed during a long generation finishes before it.

A rank is killed (SIGKILL) in the middle of a large forward_backward: the other rank
exits, torchrun ends, the server starts a new group, restores the session (last snapshot +
replay) and the SFT loop, which has no recovery code of its own, finishes with the steps it
asked for and the logprobs of one process running the same loop uninterrupted (1e-5, fp32).

    .venv/bin/python -m pytest -q tests/acceptance/test_group_server.py
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from treadle import AdamParams, Datum, ModelInput, ServiceClient
from treadle.launch import ServerProcess

TINY = "treadle/tiny-llama"
STEPS = 10
KILL_AT = 6  # a step with a batch large enough to be killed in the middle of
CONFIG = {"devices": 2, "snapshot_every_steps": 4}
# small enough that the loop is not chaotic: with 1e-2 on this random model a change of
# 1e-6 in one gradient moves the final logprobs by 5e-3, whatever computes it
LR = 1e-3


def data(step: int) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(step)
    shape = [(128, 0)] * 64 if step == KILL_AT else [(7, 0), (11, 0), (5, 0)]
    out = []
    for T, _ in shape:
        seq = rng.integers(1, 400, T + 1).tolist()
        out.append((seq[:-1], seq[1:]))
    return out


PROBE = data(10_000)


def sft_loop(url: str, on_step=None) -> tuple[list[np.ndarray], str]:
    svc = ServiceClient(base_url=url)
    tc = svc.create_lora_training_client(TINY, rank=4, seed=3)
    for step in range(STEPS):
        datums = [_datum(x, y) for x, y in data(step)]
        fb = tc.forward_backward(datums, "cross_entropy")
        if on_step is not None:
            on_step(step)
        op = tc.optim_step(AdamParams(learning_rate=LR))
        fb.result()
        op.result()
    out = tc.forward([_datum(x, y) for x, y in PROBE], "cross_entropy").result()
    path = tc.save_state("final").result().path
    svc.close()
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs], path


def _datum(tokens: list[int], targets: list[int]) -> Datum:
    return Datum(
        model_input=ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(targets)},
    )


def one_process(model_dir: Path) -> list[np.ndarray]:
    """The same loop on one Engine in this process: what the group must match."""
    from treadle.engine import Engine
    from treadle.engine.types import AdamSpec, LoraSpec, TrainBatch, TrainDatum

    def batch(pairs):
        datums = [
            TrainDatum(
                np.asarray(x, np.int64),
                {"target_tokens": np.asarray(y, np.int64), "weights": np.ones(len(y), np.float32)},
            )
            for x, y in pairs
        ]
        return [TrainBatch("m", datums)]

    engine = Engine(model_dir)
    engine.create_adapter("m", LoraSpec(rank=4, alpha=32, seed=3))
    for step in range(STEPS):
        engine.forward_backward(batch(data(step)))
        engine.optim_step("m", AdamSpec(learning_rate=LR))
    (res,) = engine.forward_backward(batch(PROBE), forward_only=True)
    return [o["logprobs"] for o in res.outputs]


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise TimeoutError(what)


@pytest.fixture(scope="module")
def group(tiny_model_dir, tmp_path_factory):
    server = ServerProcess(
        {TINY: tiny_model_dir}, tmp_path_factory.mktemp("group"), config={"devices": 2}
    ).start()
    yield server
    server.stop()


def _openai(server: ServerProcess):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="tml-x", max_retries=0, timeout=300)


def _long_chat(client, tokens: int, first_seed: int, **kw) -> tuple[dict, dict[int, str]]:
    """A chat request whose answers run to max_tokens (the random tiny model says EOS now
    and then), and its plain answer."""
    for seed in range(first_seed, first_seed + 20):
        messages = [{"role": "user", "content": f"Tell me fact number {seed}."}]
        ask = dict(model=TINY, messages=messages, max_tokens=tokens, seed=seed, **kw)
        plain = client.chat.completions.create(**ask)
        if all(c.finish_reason == "length" for c in plain.choices):
            return ask, {c.index: c.message.content for c in plain.choices}
    raise AssertionError("no seed ran to max_tokens")


def _stream(client, kw: dict, on_chunk=None) -> tuple[dict[int, str], list[float]]:
    """The streamed text of each choice, and when each content chunk came."""
    text: dict[int, str] = {}
    times: list[float] = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.delta.content:
                text[c.index] = text.get(c.index, "") + c.delta.content
                times.append(time.perf_counter())
                if on_chunk is not None:
                    on_chunk()
    return text, times


def test_chats_stream_through_a_group(group):
    """Two chats at once (one on each rank): each streams token by token while it is
    sampled (a result sampled whole would come in one burst at its end) and adds up to
    the plain answer for the same seed."""
    client = _openai(group)
    asks = [_long_chat(client, 256, 1, n=2, logprobs=True), _long_chat(client, 200, 50)]
    got: dict[int, tuple] = {}
    start = time.perf_counter()

    def run(k: int) -> None:
        got[k] = _stream(client, asks[k][0])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for k, (_, plain) in enumerate(asks):
        text, times = got[k]
        assert text == plain
        first, last = times[0] - start, times[-1] - start
        assert first < 0.5 * last, (first, last)
        # no burst at the end: a loaded host slows a stream down, it does not bunch it up
        span = times[-1] - times[0]
        bunched = sum(1 for t in times if t > times[-1] - 0.1 * span)
        assert bunched < len(times) // 2, (bunched, len(times))


def test_a_forward_backward_finishes_during_a_long_generation(group):
    """A session's forward_backward filed once another's long generation streams: it waits
    for a decode step, not for the generation (as one worker process: test_decode_loop)."""
    client = _openai(group)
    svc = ServiceClient(base_url=group.url)
    tc = svc.create_lora_training_client(TINY, rank=4, seed=3)
    kw, plain = _long_chat(client, 400, 100)
    events: list[str] = []
    streaming = threading.Event()

    def generate() -> None:
        text, _ = _stream(client, kw, on_chunk=lambda: (events.append("chunk"), streaming.set()))
        events.append("end")
        events.append(text[0])

    gen = threading.Thread(target=generate)
    gen.start()
    assert streaming.wait(120)
    fb = tc.forward_backward([_datum(x, y) for x, y in data(0)], "cross_entropy").result()
    events.append("fb")
    gen.join(300)
    assert np.isfinite(fb.metrics["loss:sum"])
    at = events.index("fb")
    assert events.index("end") > at and events[at:].count("chunk") >= 20, events[at - 3 : at + 3]
    assert events[-1] == plain[0]
    svc.close()


def test_a_rank_killed_mid_step_and_the_loop_finishes(tiny_model_dir, tmp_path):
    server = ServerProcess({TINY: tiny_model_dir}, tmp_path / "data", config=CONFIG).start()
    seen: dict[str, object] = {}

    def kill_a_rank() -> None:
        (agent,) = server.children()  # torchrun
        ranks = sorted(children(agent))
        assert len(ranks) == 2, ranks
        time.sleep(0.4)  # well inside the large forward_backward
        os.kill(ranks[1], signal.SIGKILL)
        seen["agent"], seen["ranks"] = agent, ranks
        # the group goes down: the other rank exits, torchrun ends...
        wait_for(lambda: not alive(ranks[0]), 60, "rank 0 outlived its group")
        wait_for(lambda: not alive(agent), 60, "torchrun outlived its group")
        # ...and the server starts a new group
        seen["new"] = wait_for(
            lambda: [c for c in server.children() if c != agent and len(children(c)) == 2],
            120,
            "no new group",
        )

    killer = threading.Thread(target=kill_a_rank, daemon=True)
    try:
        lps, path = sft_loop(server.url, lambda step: killer.start() if step == KILL_AT else None)
        killer.join(180)
    finally:
        server.stop()
    assert seen.get("new"), f"the group was not restarted: {seen}"
    run, _, name = path.removeprefix("tinker://").split("/")
    state = tmp_path / "data" / "artifacts" / run / "weights" / name / "treadle_state.json"
    assert json.loads(state.read_text())["step"] == STEPS  # none lost, none twice
    for a, b in zip(one_process(tiny_model_dir), lps, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    log = server.log()
    assert "the worker group is broken" in log
    assert log.count("rank 0 of 2") == 2


def test_sigterm_drains_an_fsdp_group(tiny_model_dir, tmp_path):
    """SIGTERM: rank 0 runs what was acknowledged, writes the state and releases rank 1;
    no rank fails and the server exits 0. One process then carries on from that state."""
    data_dir = tmp_path / "data"
    server = ServerProcess(
        {TINY: tiny_model_dir}, data_dir, config={"devices": 2, "shard": "fsdp"}
    ).start()
    svc = ServiceClient(base_url=server.url)
    try:
        tc = svc.create_lora_training_client(TINY, rank=4, seed=3)
        tc.forward_backward([_datum(x, y) for x, y in data(0)], "cross_entropy").result()
        tc.optim_step(AdamParams(learning_rate=LR)).result()
        pending = tc.forward_backward([_datum(x, y) for x, y in data(1)], "cross_entropy")
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(90) == 0
        log = server.log()
        assert "(gloo, fsdp)" in log
        assert "the worker group is broken" not in log and "exitcode" not in log
        states = list((data_dir / "artifacts" / ".state").rglob("treadle_state.json"))
        assert states and json.loads(states[-1].read_text())["step"] == 1
        server.config = {}  # the same data on one worker process
        server.start()
        pending.result(timeout=120)
        tc.optim_step(AdamParams(learning_rate=LR)).result()
        path = tc.save_state("after").result().path
        run, _, name = path.removeprefix("tinker://").split("/")
        state = data_dir / "artifacts" / run / "weights" / name / "treadle_state.json"
        assert json.loads(state.read_text())["step"] == 2
        svc.close()
    finally:
        server.stop()


def test_a_group_started_elsewhere_joins_the_server(tiny_model_dir, tmp_path):
    """The several-machines shape on one machine: the server waits for workers
    (--start-workers false); `treadle worker --devices 2` (torchrun under the hood) connects
    with the token, serves training and sampling, and drains on SIGTERM."""
    import subprocess
    import sys

    from treadle import SamplingParams
    from treadle.launch import free_port

    data_dir, address = tmp_path / "data", f"tcp://127.0.0.1:{free_port()}"
    shared = {"worker_address": address, "worker_token": "s3cret"}
    data_dir.mkdir()
    worker = subprocess.Popen(  # first: the server is healthy once its models' workers are in
        [sys.executable, "-m", "treadle.cli", "worker", "--model", f"{TINY}={tiny_model_dir}"]
        + ["--connect", address, "--data-dir", str(data_dir), "--devices", "2"],
        env={**os.environ, "TREADLE_WORKER_TOKEN": "s3cret"},
        stdout=open(tmp_path / "worker.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    server = ServerProcess(
        {TINY: tiny_model_dir}, data_dir, config={**shared, "start_workers": False}
    )
    try:
        server.start()
        svc = ServiceClient(base_url=server.url)
        tc = svc.create_lora_training_client(TINY, rank=4, seed=3)
        fb = tc.forward_backward([_datum(x, y) for x, y in data(0)], "cross_entropy").result()
        assert np.isfinite(fb.metrics["loss:sum"])
        tc.optim_step(AdamParams(learning_rate=LR)).result()
        sc = tc.save_weights_and_get_sampling_client("w")
        params = SamplingParams(max_tokens=4, seed=1)
        out = sc.sample(ModelInput.from_ints([1, 2, 3]), 3, params).result()
        assert [len(s.tokens) for s in out.sequences] == [4, 4, 4]
        svc.close()
        worker.send_signal(signal.SIGTERM)
        worker.wait(90)
    finally:
        if worker.poll() is None:
            worker.kill()
        server.stop()
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "rank 1 of 2" in log and "(gloo, data parallel)" in log
    assert "the worker group is broken" not in log
