"""The console's playground in headless Chromium against a real `treadle serve` with tenants:
alice picks her own sampler checkpoint, chats, and a streamed answer appears token by token
with its logprobs, through POST /v1/chat/completions and metered as her usage; bob's checkpoint
is not among her choices, and calling it from her page is refused as not found. The chat call
takes the login cookie only from a page of this origin (X-Treadle-Console and Origin).

    .venv/bin/python -m pytest -q tests/server/console/test_playground_browser.py
"""

from __future__ import annotations

import httpx
import numpy as np

from treadle import AdamParams, Datum, ModelInput, ServiceClient, TensorData

TINY = "treadle/tiny-llama"
WAIT_MS = 120_000


def trained_checkpoint(url: str, key: str, name: str) -> tuple[ServiceClient, str, str]:
    """A session of the tenant with one step taken and a sampler checkpoint saved; →
    (its service client, left open: the training model stays live), model_id, tinker path."""
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 200, 17)
    datum = Datum(
        model_input=ModelInput.from_ints(seq[:-1].tolist()),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(seq[1:].astype(np.int64)),
            "weights": TensorData.from_numpy(np.ones(16, np.float32)),
        },
    )
    svc = ServiceClient(base_url=url, api_key=key)
    tc = svc.create_lora_training_client(TINY, rank=4, alpha=8)
    tc.forward_backward([datum], "cross_entropy").result(timeout=120)
    tc.optim_step(AdamParams(learning_rate=1e-2)).result(timeout=120)
    path = tc.save_weights_for_sampler(name).result(timeout=120).path
    return svc, tc.model_id, path


def login(browser, server, key: str):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{server.url}/console/login")
    page.fill("#key", key)
    page.click("#login")
    page.wait_for_url(f"{server.url}/console")
    return page


def usage(server, key: str) -> dict:
    got = httpx.get(f"{server.url}/api/v1/treadle/usage", headers={"X-API-Key": key}, timeout=60)
    return got.json()["total"]


def test_the_playground_streams_an_answer_from_the_tenants_own_checkpoint(
    browser, tenant_server, shots_dir
):
    server, keys = tenant_server, tenant_server.keys
    alice, alice_model, alice_ckpt = trained_checkpoint(server.url, keys["alice"], "play-a")
    bob, _, bob_ckpt = trained_checkpoint(server.url, keys["bob"], "play-b")
    try:
        before = usage(server, keys["alice"])
        page = login(browser, server, keys["alice"])
        page.goto(f"{server.url}/console/playground")
        options = page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
        assert TINY in options and alice_model in options and alice_ckpt in options
        assert bob_ckpt not in options  # another tenant's checkpoint is not offered

        chat_calls = []
        page.on(
            "response",
            lambda r: chat_calls.append(r) if r.url.endswith("/v1/chat/completions") else None,
        )
        page.select_option("#model", alice_ckpt)
        page.fill("#temperature", "0.8")
        page.fill("#top-p", "0.9")
        page.fill("#max-tokens", "12")
        page.fill("#prompt", "Hello there")
        page.click("#send")
        answer = '#chat .msg.assistant[data-done="true"]'
        page.wait_for_selector(answer)
        assert page.locator("#chat-error").is_hidden(), page.inner_text("#chat-error")
        tokens = page.eval_on_selector_all(
            "#chat .msg.assistant .tok", "ts => ts.map(t => Number(t.dataset.logprob))"
        )
        assert 1 <= len(tokens) <= 12 and all(lp <= 0 for lp in tokens)
        assert page.locator("#logprobs tbody tr").count() == len(tokens)
        (call,) = chat_calls
        assert call.status == 200
        assert call.headers["content-type"].startswith("text/event-stream")  # streamed
        sent = call.request.post_data_json
        assert sent["model"] == alice_ckpt and sent["stream"] is True
        assert (sent["temperature"], sent["top_p"], sent["max_tokens"]) == (0.8, 0.9, 12)
        page.screenshot(path=str(shots_dir / "playground.png"), full_page=True)

        # metered as alice's usage, like any client's call
        after = usage(server, keys["alice"])
        assert after["sample_tokens"] - before["sample_tokens"] == len(tokens)
        assert after["prefill_tokens"] > before["prefill_tokens"]

        # bob's checkpoint, slipped into the page's choices: not found for alice's key
        page.eval_on_selector(
            "#model", "(s, v) => { const o = new Option(v, v); s.add(o); s.value = v; }", bob_ckpt
        )
        page.fill("#prompt", "And now?")
        page.click("#send")
        page.wait_for_selector("#chat-error:not([hidden])")
        assert page.inner_text("#chat-error").startswith("404")
    finally:
        alice.close()
        bob.close()


def test_the_chat_call_takes_the_cookie_only_from_a_page_of_this_origin(tenant_server):
    server, key = tenant_server, tenant_server.keys["alice"]
    host = server.url.split("://", 1)[1]
    body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cookie = {"treadle_console_key": key}

    def post(headers: dict) -> int:
        with httpx.Client(base_url=server.url, cookies=cookie, timeout=120) as c:
            return c.post("/v1/chat/completions", json=body, headers=headers).status_code

    assert post({"X-Treadle-Console": "1", "Origin": f"http://{host}"}) == 200
    assert post({"Origin": f"http://{host}"}) == 401  # no console header: a plain cookie
    assert post({"X-Treadle-Console": "1", "Origin": "http://evil.example"}) == 401
    assert post({"X-Treadle-Console": "1"}) == 401  # no Origin: not from a browser page
