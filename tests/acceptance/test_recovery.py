"""Crash recovery: training loops with no recovery code of their own, while the server (or
one engine worker) is killed with SIGKILL and started again on the same data dir.

Each loop must finish, with exactly the optimizer steps it asked for applied (read from
the saved training state) and the same final logprobs as an uninterrupted run (1e-5, fp32):
nothing the client was told succeeded is lost, and nothing runs twice.

    .venv/bin/python -m pytest -q tests/acceptance/test_recovery.py
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from treadle.launch import ServerProcess

TINY = "treadle/tiny-llama"
STEPS = 30
FAST = {"snapshot_every_steps": 4}  # snapshots and replays both happen within one loop


def data(step: int) -> list[Datum]:
    rng = np.random.default_rng(step)
    out = []
    for T in (7, 11):
        seq = rng.integers(1, 400, T + 1)
        out.append(
            Datum(
                model_input=ModelInput.from_ints(seq[:-1].tolist()),
                loss_fn_inputs={"target_tokens": seq[1:].tolist(), "weights": [1.0] * T},
            )
        )
    return out


PROBE = data(10_000)


def sft_loop(url: str, steps: int, on_step=None) -> tuple[list[np.ndarray], int, str]:
    """A plain SFT loop, as a user writes it: → (final logprobs, steps in its state, path)."""
    svc = ServiceClient(base_url=url)
    tc = svc.create_lora_training_client(TINY, rank=4, seed=3)
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        fb = tc.forward_backward(data(step), "cross_entropy")
        op = tc.optim_step(AdamParams(learning_rate=1e-2))
        fb.result()
        op.result()
    out = tc.forward(PROBE, "cross_entropy").result()
    path = tc.save_state("final").result().path
    svc.close()
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs], step + 1, path


def steps_in_state(data_dir: Path, path: str) -> int:
    run, _, name = path.removeprefix("tinker://").split("/")
    state = data_dir / "artifacts" / run / "weights" / name / "treadle_state.json"
    return json.loads(state.read_text())["step"]


def wait_filed(
    data_dir: Path, n: int, timeout_s: float = 60, kinds: str = "('forward_backward', 'optim_step')"
) -> None:
    """Until the server's database holds n requests of these kinds (each one acknowledged)."""
    db = sqlite3.connect(data_dir / "treadle.db")
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            (filed,) = db.execute(f"SELECT count(*) FROM requests WHERE kind IN {kinds}").fetchone()
            if filed >= n:
                return
            time.sleep(0.01)
    finally:
        db.close()
    raise TimeoutError(f"only {filed} of {n} requests filed")


class Chaos:
    """Kills at chosen steps of a loop, from another thread, then restarts.

    One kill at a time: a step due for a kill first waits for the previous one to have
    happened, so two chosen steps close together are two kills, never one. The thread lives
    as long as the loop: the server it restarts dies with the thread that started it.
    """

    def __init__(self, server: ServerProcess, at: set[int], whole: bool, seed: int = 0):
        self.server, self.at, self.whole = server, at, whole
        self.rng = random.Random(seed)
        self.kills = 0
        self._due: queue.Queue[int | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def on_step(self, step: int) -> None:
        if step in self.at:
            self._due.join()  # the previous kill has happened
            self._due.put(step)

    def _run(self) -> None:
        while self._due.get() is not None:
            try:
                self._kill()
            finally:
                self._due.task_done()

    def _kill(self) -> None:
        time.sleep(self.rng.uniform(0.0, 0.3))  # land in the middle of some request
        if self.whole:
            self.server.kill()
            self.server.start()
        else:
            deadline = time.monotonic() + 60
            while not (pids := self.server.children()) and time.monotonic() < deadline:
                time.sleep(0.05)  # the previous worker is still being restarted
            if not pids:
                return
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        self.kills += 1

    def close(self) -> None:
        self._due.join()
        self._due.put(None)
        self._thread.join(30)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """The uninterrupted run every chaotic one must match."""
    with ServerProcess({TINY: tiny_model_dir}, tmp_path_factory.mktemp("ref"), config=FAST) as s:
        return sft_loop(s.url, STEPS)


@pytest.mark.parametrize("whole", [True, False], ids=["server-killed", "worker-killed"])
def test_an_sft_loop_survives_five_kills(reference, tiny_model_dir, tmp_path, whole):
    server = ServerProcess({TINY: tiny_model_dir}, tmp_path / "data", config=FAST).start()
    at = set(random.Random(1 + whole).sample(range(1, STEPS - 1), 5))
    chaos = Chaos(server, at, whole)
    try:
        lps, steps, path = sft_loop(server.url, STEPS, chaos.on_step)
    finally:
        chaos.close()
        server.stop()
    assert chaos.kills == 5
    assert steps == STEPS and steps_in_state(tmp_path / "data", path) == STEPS
    for got, want in zip(lps, reference[0], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_grpo_loop_killed_while_sampling(tiny_model_dir, tmp_path):
    """Samples in flight when the server dies are acknowledged: they run after the restart,
    and the loop goes on from the sampler that made them."""
    server = ServerProcess({TINY: tiny_model_dir}, tmp_path / "data", config=FAST).start()
    try:
        svc = ServiceClient(base_url=server.url)
        tc = svc.create_lora_training_client(TINY, rank=4, seed=5)
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
        for step in range(4):
            sampler = tc.save_weights_and_get_sampling_client()
            params = SamplingParams(max_tokens=6, temperature=1.0, seed=step)
            futures = [sampler.sample(ModelInput.from_ints(p), 4, params) for p in prompts]
            if step in (1, 2):
                server.kill()  # with every sample of the step in flight
                server.start()
            datums = []
            for prompt, fut in zip(prompts, futures, strict=True):
                seqs = fut.result().sequences
                rewards = np.array([float(len(set(s.tokens))) for s in seqs])
                advantages = rewards - rewards.mean()
                for seq, adv in zip(seqs, advantages, strict=True):
                    tokens = prompt + seq.tokens
                    n = len(prompt)
                    datums.append(
                        Datum(
                            model_input=ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={
                                "target_tokens": tokens[1:],
                                "logprobs": [0.0] * (n - 1) + list(seq.logprobs),
                                "advantages": [0.0] * (n - 1) + [float(adv)] * len(seq.tokens),
                            },
                        )
                    )
            tc.forward_backward(datums, "ppo").result()
            tc.optim_step(AdamParams(learning_rate=1e-3)).result()
        path = tc.save_state("after-rl").result().path
        svc.close()
    finally:
        server.stop()
    assert steps_in_state(tmp_path / "data", path) == 4


def test_a_crash_after_the_oldest_sampler_was_dropped_is_recovered(tiny_model_dir, tmp_path):
    """An RL loop makes a sampler every step, and a model keeps only the newest
    `max_snapshots_per_model` of them. The last recorded state snapshot names samplers
    dropped since: their folders must outlive them until a newer snapshot is recorded, or
    a crash in between leaves a model that cannot be restored."""
    config = {"snapshot_every_steps": 2, "max_snapshots_per_model": 2}
    server = ServerProcess({TINY: tiny_model_dir}, tmp_path / "data", config=config).start()
    db = sqlite3.connect(tmp_path / "data" / "treadle.db")
    try:
        svc = ServiceClient(base_url=server.url)
        tc = svc.create_lora_training_client(TINY, rank=4, seed=5)
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=0)

        def step(n: int) -> None:
            tc.save_weights_and_get_sampling_client().sample(
                ModelInput.from_ints([5, 6, 7]), 2, params
            ).result()
            tc.forward_backward(data(n), "cross_entropy").result()
            tc.optim_step(AdamParams(learning_rate=1e-3)).result()

        step(0)
        step(1)  # the second optimizer step: a state snapshot naming both samplers is due
        deadline, named = time.monotonic() + 60, {}
        while len(named) < 2 and time.monotonic() < deadline:
            row = db.execute(
                "SELECT samplers FROM state_snapshots WHERE model_id = ?", (tc.model_id,)
            ).fetchone()
            named = json.loads(row[0]) if row else {}
            time.sleep(0.05)
        assert len(named) == 2, named
        # a third sampler drops the first, which the recorded snapshot still names
        latest = tc.save_weights_and_get_sampling_client()
        latest.sample(ModelInput.from_ints([5, 6, 7]), 2, params).result()
        assert all(Path(folder).is_dir() for folder in named.values())
        for pid in server.children():
            os.kill(pid, signal.SIGKILL)
        step(2)  # after the restore: the model comes back from that snapshot
        assert len(latest.sample(ModelInput.from_ints([8, 9]), 2, params).result().sequences) == 2
        path = tc.save_state("after-crash").result().path
        svc.close()
    finally:
        db.close()
        server.stop()
    assert steps_in_state(tmp_path / "data", path) == 3


def test_the_tinker_sdk_rides_out_a_restart(tiny_model_dir, tmp_path):
    tinker = pytest.importorskip("tinker")
    from tinker import types as T

    server = ServerProcess({TINY: tiny_model_dir}, tmp_path / "data", config=FAST).start()
    try:
        svc = tinker.ServiceClient(base_url=server.url, api_key="tml-recovery")
        tc = svc.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
        for step in range(8):
            batch = [
                T.Datum(
                    model_input=T.ModelInput.from_ints(d.model_input.to_ints()),
                    loss_fn_inputs={
                        "target_tokens": d.loss_fn_inputs["target_tokens"].tolist(),
                        "weights": d.loss_fn_inputs["weights"].tolist(),
                    },
                )
                for d in data(step)
            ]
            fb = tc.forward_backward(batch, "cross_entropy")
            op = tc.optim_step(T.AdamParams(learning_rate=1e-2))
            if step == 4:
                server.kill()
                server.start()
            fb.result()
            op.result()
        path = tc.save_state("tinker-final").result().path
    finally:
        server.stop()
    assert steps_in_state(tmp_path / "data", path) == 8


def test_sigterm_runs_what_was_acknowledged(tiny_model_dir, tmp_path):
    """A burst of requests in flight, then SIGTERM: after a restart, none of them failed
    (the server ran them before exiting, or runs them now)."""
    server = ServerProcess({TINY: tiny_model_dir}, tmp_path / "data", config=FAST).start()
    svc = ServiceClient(base_url=server.url)
    tc = svc.create_lora_training_client(TINY, rank=4, seed=2)
    futures = []
    for step in range(12):
        futures.append(tc.forward_backward(data(step), "cross_entropy"))
        futures.append(tc.optim_step(AdamParams(learning_rate=1e-2)))
    wait_filed(tmp_path / "data", 24)  # every request acknowledged, most not yet run
    server.stop()  # SIGTERM, then wait for the exit
    assert server.proc.returncode == 0, server.log()[-3000:]
    server.start()
    for fut in futures:
        fut.result(timeout=120)  # raises if any failed
    path = tc.save_state("after-sigterm").result().path
    svc.close()
    server.stop()
    assert steps_in_state(tmp_path / "data", path) == 12


def test_one_models_worker_dies_and_the_others_keep_serving(tiny_model_dir, tmp_path):
    """Two served models, two workers: killing one's worker leaves the other answering
    while it comes back; its own requests wait for it and then run."""
    second = "treadle/tiny-llama-b"
    models = {TINY: tiny_model_dir, second: tiny_model_dir}
    server = ServerProcess(models, tmp_path / "data", config=FAST).start()
    try:
        svc = ServiceClient(base_url=server.url)
        a = svc.create_lora_training_client(TINY, rank=4, seed=1)
        b = svc.create_lora_training_client(second, rank=4, seed=1)
        a.forward_backward(data(0), "cross_entropy").result()
        b.forward_backward(data(0), "cross_entropy").result()
        pids = server.children()
        assert len(pids) == 2
        victim = next(
            p for p in pids if "tiny-llama-b.json" in Path(f"/proc/{p}/cmdline").read_text()
        )
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        waiting = b.forward(PROBE, "cross_entropy")  # the dead one's: waits for its return
        a.forward(PROBE, "cross_entropy").result(timeout=30)  # the other one answers now
        answered_a = time.monotonic() - t0
        waiting.result(timeout=120)
        assert answered_a < 5 and not waiting.exception()
        assert len(server.children()) == 2
        svc.close()
    finally:
        server.stop()
    assert "worker process" in server.log() and "exited" in server.log()


def test_a_request_of_a_model_unloaded_before_a_crash_fails_after_the_restart(
    tiny_model_dir, tmp_path
):
    """The crash falls between a model's unloading (its row says so) and the failure of a
    request it held: after the restart that request fails with the reason; it does not
    wait for a model that no start restores."""
    server = ServerProcess({TINY: tiny_model_dir}, tmp_path / "data", config=FAST).start()
    try:
        svc = ServiceClient(base_url=server.url)
        tc = svc.create_lora_training_client(TINY, rank=4)
        tc.forward_backward(data(0), "cross_entropy").result()
        for pid in server.children():
            os.kill(pid, signal.SIGSTOP)  # the worker holds what it is sent, and runs nothing
        held = tc.forward(PROBE, "cross_entropy")
        wait_filed(tmp_path / "data", 1, kinds="('forward')")
        server.kill()
        db = sqlite3.connect(tmp_path / "data" / "treadle.db")
        with db:  # as the unload's own write leaves it
            db.execute("UPDATE models SET status = 'unloaded' WHERE model_id = ?", (tc.model_id,))
        db.close()
        server.start()
        with pytest.raises(Exception, match="was unloaded before this ran"):
            held.result(timeout=60)
        svc.close()
    finally:
        server.stop()


def test_a_future_never_hangs_on_an_engine_that_does_not_come_back(tiny_model_dir, tmp_path):
    """The model's folder disappears, so its worker cannot start again: after
    engine_down_timeout_s the waiting requests fail with a clear, retryable error."""
    import shutil

    from treadle.client.errors import APIError

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = {**FAST, "engine_down_timeout_s": 3.0}
    server = ServerProcess({TINY: model}, tmp_path / "data", config=config).start()
    try:
        svc = ServiceClient(base_url=server.url)
        tc = svc.create_lora_training_client(TINY, rank=4)
        tc.forward_backward(data(0), "cross_entropy").result()
        shutil.rmtree(model)
        for pid in server.children():
            os.kill(pid, signal.SIGKILL)
        waiting = tc.forward(PROBE, "cross_entropy")
        with pytest.raises(APIError, match="down for over"):
            waiting.result(timeout=60)
        svc.close()
    finally:
        server.stop()


def test_a_session_moves_to_another_replica_when_its_group_is_lost(
    reference, tiny_model_dir, tmp_path, capsys
):
    """Two worker groups of one model: the session's group is killed, and (its restart
    being slower than failover_after_s) the session moves to the other one, restored from
    its snapshot and op log; the loop finishes as if nothing happened."""
    import httpx

    from treadle.cli import main

    config = {**FAST, "replicas": 2, "failover_after_s": 1.0}
    server = ServerProcess({TINY: tiny_model_dir}, tmp_path / "data", config=config).start()

    def placement() -> list[dict]:
        status = httpx.get(f"{server.url}/api/v1/treadle/status").json()
        return status["models"][0]["replicas"]

    killed: list[int] = []
    moved: list[dict] = []

    def on_step(step: int) -> None:
        if step == STEPS // 2:
            (home,) = [r for r in placement() if r["sessions"] == 1]
            killed.append(home["replica"])
            os.kill(home["worker_pid"], signal.SIGKILL)
        if step == STEPS - 1:  # before the client closes (and so unloads) its session
            moved.extend(r for r in placement() if r["sessions"] == 1)

    try:
        assert len(placement()) == 2
        main(["status", "--base-url", server.url])  # what an operator sees
        table = capsys.readouterr().out.splitlines()
        assert table[0].split()[:3] == ["model", "replica", "status"]
        assert sum(TINY in line and "serving" in line for line in table) == 2
        lps, steps, path = sft_loop(server.url, STEPS, on_step)
    finally:
        server.stop()
    assert killed and moved and moved[0]["replica"] != killed[0]
    assert "moving" in server.log()
    assert steps_in_state(tmp_path / "data", path) == STEPS
    for got, want in zip(lps, reference[0], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_samplers_of_saved_checkpoints_come_back_after_a_kill(tiny_model_dir, tmp_path):
    """A sampling client made from a saved checkpoint (its tinker path, or its model package
    version GROUP:N) samples the same tokens after the server is killed and started again;
    one of an encrypted version cannot (the server never keeps the key) and says so."""
    from treadle.artifacts.encryption import new_key
    from treadle.errors import NotFoundError

    server = ServerProcess({TINY: tiny_model_dir}, tmp_path / "data").start()
    prompt, params = ModelInput.from_ints([5, 6, 7]), SamplingParams(max_tokens=6, temperature=0)
    plain = ServiceClient(base_url=server.url, model_package_group="plain")
    secret = ServiceClient(
        base_url=server.url, model_package_group="secret", encryption_key=new_key()
    )
    target = Datum(
        model_input=ModelInput.from_ints([5, 6, 7, 9, 9, 9]),
        loss_fn_inputs={"target_tokens": [6, 7, 9, 9, 9, 9], "weights": [1.0] * 6},
    )
    samplers = {}
    for name, svc in (("plain", plain), ("secret", secret)):
        tc = svc.create_lora_training_client(TINY, rank=4, seed=1)
        for _ in range(8):
            tc.forward_backward([target], "cross_entropy").result()
            tc.optim_step(AdamParams(learning_rate=5e-2)).result()
        saved = tc.save_weights_for_sampler("s1").result()
        samplers[name] = svc.create_sampling_client(f"{name}:1")
        if name == "plain":
            samplers["tinker path"] = svc.create_sampling_client(model_path=saved.path)
    base = plain.create_sampling_client(base_model=TINY)

    def tokens(sampler) -> list[int]:
        return sampler.sample(prompt, 1, params).result(timeout=120).sequences[0].tokens

    before = {name: tokens(s) for name, s in samplers.items()}
    assert before["plain"] != tokens(base)  # the adapter's own answer, not the base model's
    server.kill()
    server.start()
    try:
        assert tokens(samplers["plain"]) == before["plain"]
        assert tokens(samplers["tinker path"]) == before["plain"]
        with pytest.raises(NotFoundError, match="could not be loaded again after a restart"):
            tokens(samplers["secret"])
    finally:
        plain.close()
        secret.close()
        server.stop()
