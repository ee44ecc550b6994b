"""`treadle serve --db postgresql://...`: the API flow on PostgreSQL, and two API processes
(the engine host with its worker, and a frontend) serving the same sessions behind a
round-robin balancer; a /v1 stream filed at the frontend is live there.

The same training loop (SFT steps, sampling, a sampler checkpoint, a saved state restored)
runs through the balancer, its calls alternating between the two processes, and then
against one server: both end with the same numbers. Meanwhile a session that beats only at
the frontend stays alive at the host, and is ended once silent everywhere.

    .venv/bin/python -m pytest -q tests/postgres/test_shared.py
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from _roundrobin import RoundRobin

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from treadle.launch import ServerProcess

TINY = "treadle/tiny-llama"  # the name tests/conftest.py serves the tiny model under
WAIT = 120  # seconds any single result may take on a busy 2-core machine
KEY = "tml-postgres-tests"
HEARTBEAT_S = 12.0  # the servers' heartbeat_timeout_s (the SDK beats every 10 s)


@dataclass
class Run:
    """What one training loop produced."""

    losses: list[float]
    sampled: list[list[int]]
    live: np.ndarray  # logprobs of a probe under the trained weights (sampler)
    saved: np.ndarray  # ... under the sampler checkpoint loaded again
    restored: np.ndarray  # ... forward under the saved state loaded into a new model


def batch(seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        tokens = rng.integers(0, 200, 17).tolist()
        weights = np.ones(16, np.float32)
        out.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
    return out


PROBE = [5, 17, 42, 7, 99, 3, 64]


def train_loop(base_url: str, steps: int = 4) -> Run:
    """SFT steps on one batch, samples of the trained weights, a sampler checkpoint and a
    saved state, each loaded again."""
    with ServiceClient(base_url=base_url, api_key=KEY) as svc:
        tc = svc.create_lora_training_client(TINY, rank=4)
        data, losses = batch(0), []
        for _ in range(steps):
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(AdamParams(learning_rate=4e-3))  # in flight with the fb
            losses.append(fb.result(WAIT).metrics["loss:sum"])
            opt.result(WAIT)
        sc = tc.save_weights_and_get_sampling_client()
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        result = sc.sample(ModelInput.from_ints(PROBE[:3]), 2, params).result(WAIT)
        live = sc.compute_logprobs(ModelInput.from_ints(PROBE)).result(WAIT)
        path = tc.save_weights_for_sampler("final").result(WAIT).path
        saved_sc = svc.create_sampling_client(model_path=path)
        saved = saved_sc.compute_logprobs(ModelInput.from_ints(PROBE)).result(WAIT)
        state = tc.save_state("final").result(WAIT).path
        probe = Datum(
            model_input=ModelInput.from_ints(PROBE[:-1]),
            loss_fn_inputs={"target_tokens": PROBE[1:], "weights": np.ones(6, np.float32)},
        )
        restored = svc.create_training_client_from_state(state)
        out = restored.forward([probe]).result(WAIT)
        return Run(
            losses=losses,
            sampled=[s.tokens for s in result.sequences],
            live=np.array(live[1:], np.float32),
            saved=np.array(saved[1:], np.float32),
            restored=out.loss_fn_outputs[0]["logprobs"].to_numpy(),
        )


def check_run(run: Run) -> None:
    assert run.losses[-1] < run.losses[0], run.losses  # it learned its batch
    assert all(1 <= len(s) <= 6 for s in run.sampled)
    np.testing.assert_allclose(run.saved, run.live, atol=2e-3)  # the checkpoint holds it
    np.testing.assert_allclose(run.restored, run.live, atol=2e-3)  # so does the state


def check_live_stream(url: str, tokens: int = 192) -> None:
    """A /v1 stream filed at a frontend arrives as it is sampled at the host (its tokens are
    notified ahead of the result), and adds up to the answer sent whole."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=WAIT)
    ask = dict(model=TINY, prompt="Hello", max_tokens=tokens)
    seed = next(  # the random tiny model rarely says EOS: an answer of max_tokens
        s
        for s in range(20)
        if client.completions.create(**ask, seed=s).choices[0].finish_reason == "length"
    )
    t0, times, texts = time.perf_counter(), [], []
    for chunk in client.completions.create(**ask, seed=seed, stream=True):
        times.append(time.perf_counter() - t0)
        texts.append(chunk.choices[0].text)
    final_at = times[-1]
    before_final = [t for t in times if t < final_at - 0.05]
    assert len(before_final) >= tokens // 4, (len(before_final), times[:3], final_at)
    assert times[0] < 0.5 * final_at, (times[0], final_at)
    assert "".join(texts) == client.completions.create(**ask, seed=seed).choices[0].text


def serve(model: Path, data: Path, db_url: str, name: str, **config: object) -> ServerProcess:
    return ServerProcess(
        {TINY: model},
        data,
        config={"db_url": db_url, **config},
        log_path=data.parent / f"{name}.log",
        startup_timeout_s=240,
    ).start()


def test_the_api_flow_on_postgres(pg_url, tiny_model_dir, tmp_path):
    server = serve(tiny_model_dir, tmp_path / "data", pg_url, "server")
    try:
        run = train_loop(server.url)
        check_run(run)
        # results live in PostgreSQL: a finished future is read back after the fact
        raw = httpx.Client(base_url=f"{server.url}/api/v1", timeout=30)
        sessions = raw.get("/sessions").json()["sessions"]
        assert len(sessions) == 1
    finally:
        server.stop()


class Beats:
    """Heartbeats of one session, sent to one server every second (a thread)."""

    def __init__(self, url: str, session_id: str):
        self.url, self.session_id = url, session_id
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=f"{self.url}/api/v1", timeout=30) as http:
            while not self._stop.wait(1.0):
                body = {"session_id": self.session_id}
                self.statuses.append(http.post("/session_heartbeat", json=body).status_code)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def heartbeat(url: str, session_id: str) -> int:
    r = httpx.post(f"{url}/api/v1/session_heartbeat", json={"session_id": session_id}, timeout=30)
    return r.status_code


def session_status(db_url: str, session_id: str) -> str:
    import psycopg

    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT status FROM sessions WHERE session_id = %s", (session_id,))
        return row.fetchone()[0]


def test_two_api_processes_serve_one_loop_alternately(pg_url, tiny_model_dir, tmp_path):
    data = tmp_path / "data"  # the artifacts are shared too (a shared folder across machines)
    host = serve(tiny_model_dir, data, pg_url, "host", heartbeat_timeout_s=HEARTBEAT_S)
    try:
        front = serve(
            tiny_model_dir,
            data,
            pg_url,
            "front",
            heartbeat_timeout_s=HEARTBEAT_S,
            engine_host=False,
        )
        try:
            # a session made at the host that only the frontend hears from
            quiet = httpx.post(f"{host.url}/api/v1/create_session", json={"tags": []}).json()
            beats, started = Beats(front.url, quiet["session_id"]), time.monotonic()
            # each kind of call alternates, the first at the frontend: the host adopts the
            # session and model the frontend made
            with RoundRobin([front.port, host.port]) as lb:
                mixed = train_loop(lb.url)
                for port in (host.port, front.port):  # both filed training and sampling
                    assert lb.count(port, "/api/v1/forward_backward") > 0
                    assert lb.count(port, "/api/v1/asample") > 0
                    assert lb.count(port, "/api/v1/retrieve_future") > 0
            check_run(mixed)
            # a sampler of a checkpoint made at the frontend: its weights load at the host
            with ServiceClient(base_url=front.url, api_key=KEY) as svc:
                tc = svc.create_lora_training_client(TINY, rank=4)
                path = tc.save_weights_for_sampler("mine").result(WAIT).path
                sc = svc.create_sampling_client(model_path=path)
                lp = sc.compute_logprobs(ModelInput.from_ints(PROBE)).result(WAIT)
                assert len(lp) == len(PROBE)
            check_live_stream(front.url)

            time.sleep(max(0.0, HEARTBEAT_S + 2 - (time.monotonic() - started)))
            beats.stop()
            assert set(beats.statuses) == {200}, beats.statuses
            assert heartbeat(host.url, quiet["session_id"]) == 200  # alive at the host too

            single = train_loop(host.url)  # meanwhile the quiet session falls silent
            check_run(single)
            assert mixed.losses == pytest.approx(single.losses, rel=1e-5)
            assert mixed.sampled == single.sampled
            np.testing.assert_allclose(mixed.live, single.live, atol=1e-5)

            # silent everywhere: the host ends it (read in the database: a heartbeat to ask
            # would be a sign of life), and the frontend heard of it
            deadline = time.monotonic() + HEARTBEAT_S + 20
            while session_status(pg_url, quiet["session_id"]) == "active":
                assert time.monotonic() < deadline, "the silent session was never ended"
                time.sleep(0.5)
            assert session_status(pg_url, quiet["session_id"]) == "expired"
            time.sleep(0.5)  # the notification's way to the frontend
            assert heartbeat(front.url, quiet["session_id"]) == 410
            assert heartbeat(host.url, quiet["session_id"]) == 410
        finally:
            front.stop()
    finally:
        host.stop()
