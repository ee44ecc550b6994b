"""The console over plain HTTP against real servers: development mode opens without a key,
a tenant server sends a browser to log in and keeps the key in a cookie that authorises GETs
only, log_metrics checks what it is sent, and a cookbook loop's metrics and the server's
figures are still there after a restart.

    .venv/bin/python -m pytest -q tests/server/console/test_console_api.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import numpy as np

from treadle import AdamParams, Datum, ModelInput, ServiceClient, TensorData

TINY = "treadle/tiny-llama"


def test_development_mode_opens_without_a_key(treadle_server):
    http = httpx.Client(base_url=treadle_server.url, timeout=60)
    page = http.get("/console")
    assert page.status_code == 200 and "development mode" in page.text
    overview = http.get("/api/v1/treadle/console/overview").json()
    assert overview["viewer"] == {"tenant": "default", "admin": True, "dev_mode": True}
    assert [e["name"] for e in overview["engines"]] == [TINY]
    assert overview["engines"][0]["status"] == "serving"
    login = http.get("/console/login")
    assert login.status_code == 200 and "no key is needed" in login.text


def test_a_browser_logs_in_and_its_cookie_only_reads(tenant_server):
    url, key = tenant_server.url, tenant_server.keys["bob"]
    anonymous = httpx.Client(base_url=url, timeout=60)
    page = anonymous.get("/console/sessions?q=x")
    assert page.status_code == 303
    assert page.headers["location"] == "/console/login?next=/console/sessions"
    assert anonymous.get("/api/v1/treadle/console/sessions").status_code == 401
    static = anonymous.get("/console/static/vendor/htmx.min.js")  # no tenant data: public
    assert static.status_code == 200 and "htmx" in static.text[:200]
    assert anonymous.get("/console/static/vendor/htmx.LICENSE").status_code == 200
    wrong = anonymous.post("/console/login", data={"key": "tml-" + "q" * 43})
    assert wrong.status_code == 401 and "not recognised" in wrong.text
    evil = {"origin": "https://evil.example"}  # another site's form cannot log a browser in
    assert anonymous.post("/console/login", data={"key": key}, headers=evil).status_code == 403
    # never an open redirect: `next` must be a console page
    logged = anonymous.post("/console/login", data={"key": key, "next": "https://evil.example/"})
    assert logged.status_code == 303 and logged.headers["location"] == "/console"
    cookie = logged.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    browser = httpx.Client(base_url=url, cookies=logged.cookies, timeout=60)
    assert browser.get("/console/sessions").status_code == 200
    mine = browser.get("/api/v1/treadle/console/usage").json()
    assert mine["rows"] == [] or {r["tenant"] for r in mine["rows"]} == {"bob"}
    # the cookie authorises the console's reads, never a request that changes anything
    posted = browser.post(
        "/api/v1/treadle/metrics", json={"model_id": "x", "step": 0, "metrics": {"a": 1}}
    )  # noqa: E501
    assert posted.status_code == 401
    assert browser.post("/api/v1/create_session", json={}).status_code == 401
    assert browser.get("/api/v1/sessions").status_code == 401  # nor the API outside the console


def test_log_metrics_checks_what_it_is_sent(treadle_server):
    svc = ServiceClient(base_url=treadle_server.url)
    try:
        tc = svc.create_lora_training_client(TINY, rank=2)
        reply = tc.log_metrics(3, {"train/reward": 0.5, "train/kl": float("nan")})
        assert reply == {"recorded": 1, "skipped": ["train/kl"]}
        http = httpx.Client(base_url=treadle_server.url, timeout=60)
        for body, field in [
            ({"model_id": tc.model_id, "step": -1, "metrics": {"a": 1}}, "step"),
            ({"model_id": tc.model_id, "step": 1.5, "metrics": {"a": 1}}, "step"),
            ({"model_id": tc.model_id, "step": 1, "metrics": {"a": "b"}}, "metrics.a"),
            ({"model_id": tc.model_id, "step": 1, "metrics": {"server/loss": 1}}, "server/"),
        ]:
            got = http.post("/api/v1/treadle/metrics", json=body)
            assert got.status_code == 400 and field in got.json()["error"], (body, got.text)
        missing = http.post(
            "/api/v1/treadle/metrics",
            json={"model_id": "nope:train:0", "step": 1, "metrics": {"a": 1}},
        )
        assert missing.status_code == 404
        curves = http.get(f"/api/v1/treadle/console/sessions/{svc.session_id}/metrics").json()
        assert curves["series"]["train/reward"] == {"steps": [3], "values": [0.5]}
        assert curves["sources"]["train/reward"] == "user"
    finally:
        svc.close()


def test_a_cookbook_loops_metrics_and_the_servers_figures_survive_a_restart(start_server, tmp_path):  # noqa: E501
    from treadle.cookbook.recipes import math_rl

    server = start_server()
    cfg = math_rl.Config(
        model=TINY,
        run_dir=str(tmp_path / "run"),
        base_url=server.url,
        prompt_format="raw",
        batch_size=2,
        group_size=4,
        max_tokens=8,
        max_steps=2,
        eval_every=1,
        n_test=2,
        eval_samples=1,
        save_every=0,
    )
    math_rl.main(cfg)
    # a plain loop too: two forward_backward chunks and an optim_step per step
    svc = ServiceClient(base_url=server.url)
    tc = svc.create_lora_training_client(TINY, rank=2)
    rng = np.random.default_rng(0)
    for _ in range(2):
        seq = rng.integers(0, 200, 9)
        d = Datum(
            model_input=ModelInput.from_ints(seq[:-1].tolist()),
            loss_fn_inputs={
                "target_tokens": TensorData.from_numpy(seq[1:].astype(np.int64)),
                "weights": TensorData.from_numpy(np.array([1, 1, 1, 0, 0, 0, 0, 0], np.float32)),
            },
        )
        tc.forward_backward([d], "cross_entropy").result()
        tc.forward_backward([d], "cross_entropy").result()
        tc.optim_step(AdamParams(learning_rate=1e-3)).result()
    plain = svc.session_id
    svc.close()
    server.stop()

    again = start_server(data_dir=server.data_dir)
    http = httpx.Client(base_url=again.url, timeout=60)
    sessions = http.get("/api/v1/treadle/console/sessions").json()["sessions"]
    assert len(sessions) == 2 and {s["status"] for s in sessions} <= {"finished", "expired"}
    (rl,) = [s["session_id"] for s in sessions if s["session_id"] != plain]
    series = http.get(f"/api/v1/treadle/console/sessions/{rl}/metrics").json()["series"]
    assert series["train/reward"]["steps"] == [0, 1]
    assert series["test/reward"]["steps"] == [0, 1, 2]  # the final evaluation at max_steps
    assert series["train/tokens"]["steps"] == [0, 1]
    # the plain loop: loss per loss token over both chunks of a step, tokens of both
    series = http.get(f"/api/v1/treadle/console/sessions/{plain}/metrics").json()["series"]
    assert series["server/loss_tokens"]["values"] == [6.0, 6.0]
    assert series["server/tokens"]["values"] == [16.0, 16.0]
    for step, (total, per_token) in enumerate(
        zip(series["server/loss_sum"]["values"], series["server/loss"]["values"], strict=True)
    ):
        assert abs(total / 6 - per_token) < 1e-9, step
    line = http.get(f"/api/v1/treadle/console/sessions/{plain}/timeline").json()
    assert line["summary"]["forward_backward"]["count"] == 4
    assert line["summary"]["optim_step"]["count"] == 2
    page = http.get(f"/console/sessions/{rl}")
    assert page.status_code == 200 and 'id="curves"' in page.text
    assert 'id="percentiles"' in page.text


def test_an_admin_key_made_by_the_cli_sees_every_tenant(tenant_server):
    def cli(*args: str) -> str:
        cmd = [sys.executable, "-m", "treadle.cli", "admin", *args]
        cmd += ["--data-dir", str(tenant_server.data_dir)]
        return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout

    key = cli("create-key", "bob", "--admin").strip()
    plain = tenant_server.keys["bob"]
    for k, admin in ((key, True), (plain, False)):
        got = httpx.get(
            f"{tenant_server.url}/api/v1/treadle/console/overview", headers={"X-API-Key": k}
        )
        assert got.json()["viewer"] == {"tenant": "bob", "admin": admin, "dev_mode": False}
    (bob,) = [t for t in json.loads(cli("list")) if t["name"] == "bob"]
    assert [k.get("admin", False) for k in bob["keys"]] == [False, True]
