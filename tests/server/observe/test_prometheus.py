"""A real Prometheus (Debian's `prometheus`) scrapes a real `treadle serve` with tenants while
a tenant's loop trains, samples and loses its worker (killed); Prometheus's HTTP API then
shows the series that must have moved: requests by route, ops and their latency and queue
wait, tokens by kind and tenant, engine calls, decode steps, snapshots, the worker's restart
and loss, the restore, database commits, live sessions; and no label holds an id.

Skips, saying why, when the `prometheus` binary is missing (apt-get install prometheus).

    .venv/bin/python -m pytest -q tests/server/observe/test_prometheus.py
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient, TensorData
from treadle.launch import ServerProcess, free_port

TINY = "treadle/tiny-llama"
STEPS = 3
ROWS, LEN = 2, 16  # each forward_backward: 2 datums of 16 tokens
WAIT_S = 120.0


def datum(rng: np.random.Generator) -> Datum:
    seq = rng.integers(0, 200, LEN + 1)
    return Datum(
        model_input=ModelInput.from_ints(seq[:-1].tolist()),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(seq[1:].astype(np.int64)),
            "weights": TensorData.from_numpy(np.ones(LEN, np.float32)),
        },
    )


def make_tenants(data_dir: Path) -> dict[str, str]:
    from treadle.server.storage.database import Store
    from treadle.server.tenancy import tenants

    data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(f"sqlite:///{data_dir.resolve() / 'treadle.db'}")
    try:
        keys = {}
        for name in ("alice", "ops"):
            tenants.create_tenant(store, name)
            keys[name], _ = tenants.create_key(store, name, admin=name == "ops")
        return keys
    finally:
        store.close()


class Prometheus:
    """A Prometheus server in a temporary folder, scraping one target every second."""

    def __init__(self, root: Path, target: str, bearer: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = root / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: treadle\n"
            "    scrape_interval: 1s\n"
            "    authorization: {type: Bearer, credentials: " + bearer + "}\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n"
        )
        self.log = root / "prometheus.log"
        cmd = [
            shutil.which("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def value(self, expr: str) -> float | None:
        found = self.query(expr)
        return float(found[0]["value"][1]) if found else None

    def wait_for(self, expr: str, ok, timeout_s: float = WAIT_S) -> float:
        """Until `expr`'s value satisfies ok(value) (scrapes come every second)."""
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log.read_text()[-3000:]}")
            try:
                last = self.value(expr)
            except httpx.TransportError:
                last = None
            except httpx.HTTPStatusError as e:  # 503 until its storage is open (/-/ready)
                if e.response.status_code != 503:
                    raise
                last = None
            if last is not None and ok(last):
                return last
            time.sleep(0.5)
        raise AssertionError(f"{expr} = {last} after {timeout_s} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def scraped(tiny_model_dir, tmp_path_factory):
    """(server, prometheus, keys)"""
    if shutil.which("prometheus") is None:
        pytest.skip("needs Prometheus: apt-get install prometheus (Debian's package)")
    data = tmp_path_factory.mktemp("metrics")
    keys = make_tenants(data)
    server = ServerProcess(
        {TINY: tiny_model_dir},
        data,
        config={"snapshot_every_steps": 1, "snapshot_every_s": 0.5},
        startup_timeout_s=180,
    ).start()
    prom = Prometheus(
        tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{server.port}", keys["ops"]
    )
    yield server, prom, keys
    prom.stop()
    server.stop()


def test_prometheus_sees_a_training_loop(scraped):
    server, prom, keys = scraped
    prom.wait_for('up{job="treadle"}', lambda v: v == 1)  # it scrapes with the admin key
    rng = np.random.default_rng(0)
    svc = ServiceClient(base_url=server.url, api_key=keys["alice"])
    try:
        tc = svc.create_lora_training_client(TINY, rank=4, alpha=8)
        for _ in range(STEPS):
            fb = tc.forward_backward([datum(rng) for _ in range(ROWS)], "cross_entropy")
            op = tc.optim_step(AdamParams(learning_rate=1e-2))
            fb.result(timeout=WAIT_S)
            op.result(timeout=WAIT_S)
        sampler = tc.save_weights_and_get_sampling_client()
        prompt = ModelInput.from_ints([1, 2, 3, 4, 5])
        got = sampler.sample(prompt, 2, SamplingParams(max_tokens=6, seed=0)).result(WAIT_S)
        sampled = sum(len(s.tokens) for s in got.sequences)

        prom.wait_for(
            'treadle_ops_total{kind="forward_backward",status="done"}', lambda v: v == STEPS
        )
        prom.wait_for('treadle_op_latency_seconds_count{kind="optim_step"}', lambda v: v == STEPS)
        prom.wait_for(
            'treadle_op_queue_seconds_count{kind="forward_backward"}', lambda v: v == STEPS
        )
        # queue wait within latency, both positive
        assert (
            0
            < prom.value('treadle_op_queue_seconds_sum{kind="forward_backward"}')
            < (prom.value('treadle_op_latency_seconds_sum{kind="forward_backward"}'))
        )
        prom.wait_for(
            'treadle_tokens_total{kind="train",tenant="alice"}', lambda v: v == STEPS * ROWS * LEN
        )
        prom.wait_for('treadle_tokens_total{kind="sample",tenant="alice"}', lambda v: v == sampled)
        prom.wait_for('treadle_tokens_total{kind="prefill",tenant="alice"}', lambda v: v >= 5)
        route = 'treadle_http_requests_total{route="/api/v1/forward_backward",status="200"}'
        prom.wait_for(route, lambda v: v >= STEPS)
        prom.wait_for(
            'sum(treadle_http_requests_total{route="/api/v1/retrieve_future"})',
            lambda v: v >= STEPS,
        )
        prom.wait_for(
            f'treadle_engine_calls_total{{model="{TINY}",kind="train"}}', lambda v: v >= 1
        )
        prom.wait_for(f'treadle_decode_steps_total{{model="{TINY}"}}', lambda v: v >= 5)
        prom.wait_for(f'treadle_decode_rows_total{{model="{TINY}"}}', lambda v: v >= 5)
        prom.wait_for(f'treadle_snapshot_seconds_count{{model="{TINY}"}}', lambda v: v >= 1)
        prom.wait_for("treadle_db_commit_seconds_count", lambda v: v >= 2 * STEPS)
        prom.wait_for("treadle_sessions_live", lambda v: v == 1)
        prom.wait_for("treadle_samplers_live", lambda v: v >= 1)
        prom.wait_for(f'treadle_queue_depth{{model="{TINY}"}}', lambda v: v == 0)
        assert prom.value(f'treadle_restore_seconds_count{{model="{TINY}"}}') == 1  # start-up

        # the worker is killed: restarted, the loss counted, the models restored
        (worker,) = server.children()
        os.kill(worker, signal.SIGKILL)
        fb = tc.forward_backward([datum(rng) for _ in range(ROWS)], "cross_entropy")
        fb.result(timeout=WAIT_S)
        prom.wait_for(f'treadle_worker_restarts_total{{model="{TINY}"}}', lambda v: v == 1)
        prom.wait_for(f'sum(treadle_engine_faults_total{{model="{TINY}"}})', lambda v: v == 1)
        prom.wait_for(f'treadle_restore_seconds_count{{model="{TINY}"}}', lambda v: v == 2)

        # no label holds an id (of a session, a training model, a sampler)
        ids = {svc.session_id, tc.model_id, sampler.sampling_session_id}
        series = httpx.get(
            f"{prom.url}/api/v1/series", params={"match[]": '{__name__=~"treadle_.+"}'}, timeout=10
        ).json()["data"]
        assert len(series) > 30
        for labels in series:
            assert not ids & set(labels.values()), labels
    finally:
        svc.close()


def test_metrics_take_an_admin_key_from_outside_the_networks(scraped):
    server, _, keys = scraped
    # loopback is not in metrics_networks by default once tenants exist: a key is needed
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    tenant = httpx.get(f"{server.url}/metrics", headers={"X-API-Key": keys["alice"]})
    assert tenant.status_code == 403, tenant.text
    admin = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {keys['ops']}"})
    assert admin.status_code == 200
    assert admin.headers["content-type"].startswith("text/plain")
    assert "# TYPE treadle_ops_total counter" in admin.text
