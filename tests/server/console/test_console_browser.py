"""The console in headless Chromium against a real `treadle serve` with tenants: a loop runs 5
steps while the test watches its session page (the curves gain points, the step counter
moves, a checkpoint appears), the usage page shows exactly what GET /api/v1/treadle/usage
says, another tenant sees none of it, an admin key sees every tenant, and a spend cap stops a
loop with its documented error. Every page is saved as a screenshot
(runs/console-screenshots/, or TREADLE_SCREENSHOTS).

Waits are on DOM conditions with generous timeouts (a loaded 2-core machine), never sleeps.

    .venv/bin/python -m pytest -q tests/server/console/test_console_browser.py
"""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient, TensorData
from treadle.client.errors import RateLimitError

TINY = "treadle/tiny-llama"
WAIT_MS = 120_000
STEPS = 5
SAVE_AT = 2  # the loop saves a checkpoint after this step


def datum(rng: np.random.Generator, n: int = 16) -> Datum:
    seq = rng.integers(0, 200, n + 1)
    return Datum(
        model_input=ModelInput.from_ints(seq[:-1].tolist()),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(seq[1:].astype(np.int64)),
            "weights": TensorData.from_numpy(np.ones(n, np.float32)),
        },
    )


class Loop(threading.Thread):
    """A small training loop of one tenant (forward_backward, optim_step, a few samples,
    its own metrics; a checkpoint after step SAVE_AT), one step each time `go` is released."""

    def __init__(
        self, url: str, key: str, steps: int = STEPS, gated: bool = True, group: str | None = None
    ):
        super().__init__(daemon=True)
        self.url, self.key, self.steps, self.group = url, key, steps, group
        self.go = threading.Semaphore(0 if gated else steps)
        self.ready = threading.Event()
        self.done = 0
        self.saved: str | None = None
        self.error: BaseException | None = None
        self.session_id: str | None = None

    def run(self) -> None:
        rng = np.random.default_rng(0)
        svc = None
        try:
            # with a model package group, every save is a version too
            svc = ServiceClient(base_url=self.url, api_key=self.key, model_package_group=self.group)
            tc = svc.create_lora_training_client(TINY, rank=4, alpha=8)
            self.session_id = svc.session_id
            self.ready.set()
            for step in range(self.steps):
                if not self.go.acquire(timeout=600):
                    raise TimeoutError("the test never released the next step")
                fb = tc.forward_backward([datum(rng), datum(rng)], "cross_entropy")
                op = tc.optim_step(AdamParams(learning_rate=1e-2))
                nll = fb.result(timeout=120).metrics["loss:sum"] / 32
                op.result(timeout=120)
                sampler = tc.save_weights_and_get_sampling_client()
                prompt = ModelInput.from_ints(rng.integers(0, 200, 6).tolist())
                res = sampler.sample(prompt, 2, SamplingParams(max_tokens=4, seed=step))
                res.result(timeout=120)
                tc.log_metrics(step, {"train/reward": 0.1 * step, "train/nll": nll})
                if step == SAVE_AT:
                    self.saved = tc.save_state(f"step-{step + 1}").result(timeout=120).path
                self.done = step + 1
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e
        finally:
            self.ready.set()
            if svc is not None:
                svc.close()


def login(browser, server, key: str):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{server.url}/console/login")
    page.fill("#key", key)
    page.click("#login")
    page.wait_for_url(f"{server.url}/console")
    return page


def shot(page, shots_dir, name: str) -> None:
    page.screenshot(path=str(shots_dir / f"{name}.png"), full_page=True)


def wait_points(page, metric: str, n: int) -> None:
    page.wait_for_function(
        '([m, n]) => { const f = document.querySelector(`#curves figure[data-metric="${m}"]`);'
        " return f && Number(f.dataset.points) === n; }",
        arg=[metric, n],
        timeout=WAIT_MS,
    )


def wait_attr(page, selector: str, attr: str, value: str) -> None:
    page.wait_for_function(
        "([s, a, v]) => { const e = document.querySelector(s); return e && e.getAttribute(a) === v; }",
        arg=[selector, attr, value],
        timeout=WAIT_MS,
    )


def api(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"X-API-Key": key}, timeout=60)


@pytest.fixture(scope="module")
def alice_run(browser, tenant_server, shots_dir):
    """Alice's loop, watched step by step on her session page; → (loop, page)."""
    loop = Loop(tenant_server.url, tenant_server.keys["alice"], group="alice-run")
    loop.start()
    assert loop.ready.wait(180) and loop.error is None, loop.error
    page = login(browser, tenant_server, tenant_server.keys["alice"])
    page.goto(f"{tenant_server.url}/console/sessions/{loop.session_id}")
    page.wait_for_selector("#curves")
    for step in range(STEPS):
        loop.go.release()
        wait_points(page, "train/reward", step + 1)  # the loop's own curve
        wait_points(page, "server/loss", step + 1)  # the server's figures of the same step
        wait_attr(page, "#step-counter", "data-step", str(step))  # the counter moves (htmx)
        assert loop.error is None, loop.error
    loop.join(120)
    assert loop.done == STEPS and loop.error is None, loop.error
    page.wait_for_selector(f'#checkpoints tr[data-path="{loop.saved}"]', timeout=WAIT_MS)
    wait_attr(page, "#steps-taken", "data-steps", str(STEPS))
    return loop, page


def test_the_session_page_follows_a_live_loop(alice_run, tenant_server, shots_dir):
    loop, page = alice_run
    for metric in (
        "train/reward",
        "train/nll",
        "server/loss",
        "server/grad_norm",
        "server/learning_rate",
        "server/tokens",
    ):
        wait_points(page, metric, STEPS)
    # the request timeline: percentiles per kind, and a drawing of every op
    page.wait_for_selector('#percentiles tr[data-kind="forward_backward"]')
    page.wait_for_selector('#percentiles tr[data-kind="sample"]')
    assert page.locator("#timeline g.op").count() >= 3 * STEPS
    shot(page, shots_dir, "session")
    # the same figures as JSON, for scripts
    curves = (
        api(tenant_server, tenant_server.keys["alice"])
        .get(f"/api/v1/treadle/console/sessions/{loop.session_id}/metrics")
        .json()
    )
    assert curves["series"]["train/reward"]["steps"] == list(range(STEPS))
    assert curves["series"]["server/tokens"]["values"] == [32.0] * STEPS
    # the trace downloads as Chrome/Perfetto JSON
    with page.expect_download() as download:
        page.click("#trace-link")
    assert download.value.suggested_filename.endswith("-trace.json")


def test_every_page_shows_the_tenants_own_figures(alice_run, tenant_server, shots_dir):
    loop, page = alice_run
    alice = api(tenant_server, tenant_server.keys["alice"])
    server = tenant_server.url
    page.goto(f"{server}/console/usage")
    total = alice.get("/api/v1/treadle/usage").json()["total"]
    assert total["train_tokens"] == 32 * STEPS and total["sample_tokens"] > 0
    for field, key in (
        ("prefill", "prefill_tokens"),
        ("sample", "sample_tokens"),
        ("train", "train_tokens"),
    ):
        wait_attr(page, f"#usage-{field}", "data-value", str(total[key]))
    cost = float(page.get_attribute("#usage-cost", "data-value"))
    assert cost == pytest.approx(total["cost_usd"], rel=1e-9) and cost > 0
    page.wait_for_function(
        "() => document.querySelector('[data-chart=days]').dataset.points === '1'"
    )
    shot(page, shots_dir, "usage")
    # the cost of the session so far, on its page, is its row of the usage report
    by_session = alice.get("/api/v1/treadle/usage", params={"by": "session"}).json()["rows"]
    (row,) = [r for r in by_session if r["key"] == loop.session_id]
    page.goto(f"{server}/console/sessions/{loop.session_id}")
    assert float(page.get_attribute("#session-cost", "data-usd")) == pytest.approx(row["cost_usd"])
    page.goto(f"{server}/console/sessions")
    page.wait_for_selector(f'#sessions tr[data-session="{loop.session_id}"]')
    assert page.get_attribute(
        f'#sessions tr[data-session="{loop.session_id}"] td[data-steps]', "data-steps"
    ) == str(STEPS)
    page.fill("#filter-q", "no-such-session")
    page.press("#filter-q", "Enter")
    page.wait_for_selector(f'#sessions tr[data-session="{loop.session_id}"]', state="detached")
    page.goto(f"{server}/console/sessions")
    shot(page, shots_dir, "sessions")
    page.goto(f"{server}/console/checkpoints")
    page.wait_for_selector(f'#tinker-checkpoints tr[data-path="{loop.saved}"]')
    group = page.locator('section.group[data-group="alice-run"]')
    # a version per sampler refresh and one for the saved state, newest first
    group.locator('tr[data-ref="alice-run:1"]').wait_for()
    assert group.locator("tr[data-ref]").count() == STEPS + 1
    with page.expect_download() as download:
        group.locator('tr[data-ref="alice-run:1"] a', has_text="download").click()
    assert download.value.suggested_filename == "alice-run-v1.tar"
    shot(page, shots_dir, "checkpoints")
    page.goto(f"{server}/console")
    page.wait_for_selector(f'#engines tr[data-engine="{TINY}"]')
    page.wait_for_function("() => document.querySelector('[data-chart=tokens]').dataset.points > 0")
    shot(page, shots_dir, "overview")


def test_another_tenant_sees_none_of_it(alice_run, browser, tenant_server, shots_dir):
    loop, _ = alice_run
    server = tenant_server.url
    bob_loop = Loop(server, tenant_server.keys["bob"], steps=1, gated=False)
    bob_loop.start()
    bob_loop.join(300)
    assert bob_loop.done == 1, bob_loop.error
    page = login(browser, tenant_server, tenant_server.keys["bob"])
    secrets = [loop.session_id, loop.saved.split("/")[2], "alice"]
    for path in (
        "/console",
        "/console/sessions",
        "/console/checkpoints",
        "/console/usage",
        "/console/sessions?tenant=alice",
        "/console/usage?tenant=alice&by=session",
    ):
        page.goto(server + path)
        page.wait_for_selector("main")
        html = page.content()
        assert not [s for s in secrets if s in html], path
    page.goto(f"{server}/console/sessions")
    page.wait_for_selector(f'#sessions tr[data-session="{bob_loop.session_id}"]')
    reply = page.goto(f"{server}/console/sessions/{loop.session_id}")
    assert reply.status == 404 and "not found" in page.inner_text("#error")
    shot(page, shots_dir, "other-tenant-404")
    bob = api(tenant_server, tenant_server.keys["bob"])
    page.goto(f"{server}/console/usage")
    train = bob.get("/api/v1/treadle/usage").json()["total"]["train_tokens"]
    assert train == 32
    wait_attr(page, "#usage-train", "data-value", str(train))
    for path in ("overview", "sessions", "checkpoints", "usage"):
        text = bob.get(f"/api/v1/treadle/console/{path}", params={"tenant": "alice"}).text
        assert not [s for s in secrets if s in text], path
    for tail in ("", "/metrics", "/timeline", "/trace"):
        got = bob.get(f"/api/v1/treadle/console/sessions/{loop.session_id}{tail}")
        assert got.status_code == 404, tail


def test_an_admin_key_sees_every_tenant(alice_run, browser, tenant_server, shots_dir):
    loop, _ = alice_run
    page = login(browser, tenant_server, tenant_server.keys["ops"])
    page.goto(f"{tenant_server.url}/console/sessions")
    page.wait_for_selector(f'#sessions tr[data-session="{loop.session_id}"]')
    assert "all tenants" in page.inner_text("#viewer")
    shot(page, shots_dir, "admin-sessions")
    page.goto(f"{tenant_server.url}/console/sessions/{loop.session_id}")
    wait_points(page, "train/reward", STEPS)
    # ?tenant= narrows an admin's view to one tenant
    page.goto(f"{tenant_server.url}/console/sessions?tenant=bob")
    page.wait_for_selector("#sessions")
    assert page.locator(f'#sessions tr[data-session="{loop.session_id}"]').count() == 0


def test_a_spend_cap_stops_a_loop_with_its_error(browser, tenant_server, shots_dir):
    cap = 100  # tokens a day; each step trains 32
    subprocess.run(
        [
            sys.executable,
            "-m",
            "treadle.cli",
            "admin",
            "set-spend-cap",
            "carol",
            "--period",
            "day",
            "--tokens",
            str(cap),
            "--data-dir",
            str(tenant_server.data_dir),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    carol = api(tenant_server, tenant_server.keys["carol"])
    page = login(browser, tenant_server, tenant_server.keys["carol"])
    page.goto(f"{tenant_server.url}/console/usage")
    page.wait_for_selector(
        '#caps tr[data-scope="tenant"][data-period="day"]'
    )  # the server knows it
    loop = Loop(tenant_server.url, tenant_server.keys["carol"], steps=10, gated=False)
    loop.start()
    loop.join(600)
    assert isinstance(loop.error, RateLimitError), loop.error
    message = str(loop.error)
    assert "spend cap tokens_per_day (100 tokens) of tenant 'carol' reached" in message
    assert "resets at" in message
    # checked before each metered operation: the loop stops once the cap is reached (an
    # operation or two later when results land between one's check and the next)
    assert 1 <= loop.done <= 4, loop.done
    spent = carol.get("/api/v1/treadle/usage").json()["total"]
    tokens = spent["prefill_tokens"] + spent["sample_tokens"] + spent["train_tokens"]
    assert cap <= tokens <= cap + 2 * 32, spent
    wait_attr(page, '#caps tr[data-scope="tenant"]', "data-spent-tokens", str(tokens))
    shot(page, shots_dir, "usage-spend-cap")
    listed = subprocess.run(
        [
            sys.executable,
            "-m",
            "treadle.cli",
            "admin",
            "list",
            "--data-dir",
            str(tenant_server.data_dir),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert '"max_tokens": 100' in listed


def test_the_login_page(browser, tenant_server, shots_dir):
    context = browser.new_context(viewport={"width": 1280, "height": 700})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{tenant_server.url}/console/sessions")  # no key: sent to log in first
    page.wait_for_url("**/console/login?next=/console/sessions")
    page.fill("#key", "tml-" + "x" * 43)
    page.click("#login")
    assert "not recognised" in page.inner_text("#login-error")
    shot(page, shots_dir, "login")
    page.fill("#key", tenant_server.keys["bob"])
    page.click("#login")
    page.wait_for_url(f"{tenant_server.url}/console/sessions")
    page.goto(f"{tenant_server.url}/console/logout")
    page.wait_for_url("**/console/login")
    page.goto(f"{tenant_server.url}/console")
    page.wait_for_url("**/console/login?next=/console")
