"""Metering against a real `treadle serve`: a known loop through the official tinker SDK,
each counter compared exactly with the token counts the test computes from what it sent
and received; costs from the price table; the usage every result carries.

    .venv/bin/python -m pytest -q tests/server/tenancy/test_metering.py
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys

import numpy as np
import pytest
from _tenancy import TINY, Api

from treadle.server.tenancy.metering import proto_usage
from treadle.wire import codec

PRICES = {TINY: {"prefill": 0.5, "sample": 2.0, "train": 3.0}}  # $ per million tokens


def test_a_known_loop_is_metered_exactly(start_server):
    tinker = pytest.importorskip("tinker")
    from tinker import types as T

    server = start_server(config={"prices": PRICES})
    rng = np.random.default_rng(0)

    def datum(n: int) -> T.Datum:
        seq = rng.integers(0, 200, n + 1).tolist()
        return T.Datum(
            model_input=T.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * n},
        )

    def prompt(n: int) -> T.ModelInput:
        return T.ModelInput.from_ints(rng.integers(0, 200, n).tolist())

    sc = tinker.ServiceClient(base_url=server.url, api_key="tml-metering")
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    sent_train: list[T.Datum] = []
    for lengths in ([5, 9, 12], [7, 3]):
        batch = [datum(n) for n in lengths]
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(T.AdamParams(learning_rate=1e-3)).result()
        sent_train += batch
    scored = [datum(11)]
    tc.forward(scored, "cross_entropy").result()
    sent_train += scored
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompts = [prompt(6), prompt(4)]
    results = [
        sampler.sample(prompts[0], 3, T.SamplingParams(max_tokens=5, seed=1)).result(),
        sampler.sample(prompts[1], 1, T.SamplingParams(max_tokens=7, seed=2)).result(),
    ]
    scored_prompt = prompt(10)
    sampler.compute_logprobs(scored_prompt).result()
    sc.close("success").result(timeout=30)

    # What the loop sent and got back, counted here:
    train = sum(d.model_input.length for d in sent_train)  # every datum of forward(_backward)
    prefill = sum(p.length for p in prompts) + scored_prompt.length  # once per request
    # every generated token; compute_logprobs is a sample of max_tokens=1: one token
    sample = sum(len(s.tokens) for r in results for s in r.sequences) + 1
    assert (train, prefill) == (5 + 9 + 12 + 7 + 3 + 11, 6 + 4 + 10)

    api = Api(server.url, "tml-metering")
    report = api.get("treadle/usage").json()
    total = report["total"]
    assert (total["prefill_tokens"], total["sample_tokens"], total["train_tokens"]) == (
        prefill,
        sample,
        train,
    )
    cost = (prefill * 0.5 + sample * 2.0 + train * 3.0) / 1e6
    assert total["cost_usd"] == pytest.approx(cost, rel=1e-9)
    by_model = api.get("treadle/usage", params={"by": "model"}).json()["rows"]
    assert [(r["key"], r["train_tokens"]) for r in by_model] == [(TINY, train)]
    by_session = api.get("treadle/usage", params={"by": "session"}).json()["rows"]
    assert len(by_session) == 1 and by_session[0]["sample_tokens"] == sample
    today = dt.datetime.now(dt.UTC).date().isoformat()
    by_day = api.get("treadle/usage", params={"by": "day", "since": today}).json()["rows"]
    assert [r["key"] for r in by_day] == [today] and by_day[0]["prefill_tokens"] == prefill
    future = api.get("treadle/usage", params={"since": "2999-01-01"}).json()["total"]
    assert future["requests"] == 0
    assert api.get("treadle/usage", params={"by": "week"}).status_code == 400

    # the CLI reads the same database, with the prices of the server's config file
    config = next(server.data_dir.glob("config-*.json"))
    out = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "usage", "--data-dir", str(server.data_dir)]
        + ["--config", str(config), "--by", "model", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    cli_total = json.loads(out.stdout)["total"]
    assert cli_total == {**total, "requests": cli_total["requests"]}
    assert cli_total["cost_usd"] == pytest.approx(cost, rel=1e-9)
    text = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "usage", "--url", server.url]
        + ["--api-key", "tml-metering", "--by", "day"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert today in text and str(train) in text


def test_each_result_carries_its_usage(treadle_server):
    api = Api(treadle_server.url, "tml-metering")
    sid = api.session()
    model = api.model(sid)
    rid = api.forward(model, 1, [4, 6]).json()["request_id"]
    as_json = api.done(rid)
    assert as_json["usage"] == {
        "prefill_tokens": 0,
        "sample_tokens": 0,
        "train_tokens": 10,
        "cached_prefill_tokens": 0,
    }
    body = api.result(rid, proto=True).content
    assert proto_usage(body) == as_json["usage"]
    # the extra field is invisible to protobuf parsers, ours and the official SDK's
    assert len(codec.decode_forward_backward_output(body).loss_fn_outputs) == 2
    tinker_conv = pytest.importorskip("tinker.proto.response_conv")
    assert len(tinker_conv.deserialize_forward_backward_output(body).loss_fn_outputs) == 2
    sampler = api.sampler(sid)
    sample = {
        "sampling_session_id": sampler,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": 4, "seed": 3},
    }
    rid = api.ok("asample", sample)["request_id"]
    body = api.result(rid, proto=True).content
    got = codec.decode_sample_response(body)
    assert len(tinker_conv.deserialize_sample_response(body).sequences) == 2
    generated = sum(len(s.tokens) for s in got.sequences)
    assert proto_usage(body) == {
        "prefill_tokens": 3,
        "sample_tokens": generated,
        "train_tokens": 0,
        "cached_prefill_tokens": 0,
    }
    assert api.done(rid)["usage"] == proto_usage(body)
    adam = {"learning_rate": 1e-3}
    step = api.ok("optim_step", {"model_id": model, "seq_id": 2, "adam_params": adam})
    assert "usage" not in api.done(step["request_id"])  # only token operations carry usage


def test_prefix_cache_hits_are_reported_and_metered_at_their_own_price(start_server):
    """The next request on one prompt and the next turn of a conversation reuse the cached
    prompt: the official SDK reads the hit tokens, the meter counts them apart and prices
    them at the cached rate (a fraction of prefill unless the price names one)."""
    tinker = pytest.importorskip("tinker")
    from tinker import types as T

    prices = {TINY: {"prefill": 0.5, "sample": 2.0, "train": 3.0, "cached_prefill": 0.1}}
    server = start_server(config={"prices": prices})
    sc = tinker.ServiceClient(base_url=server.url, api_key="tml-metering")
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = np.random.default_rng(5).integers(0, 200, 40).tolist()
    turn2 = prompt + [7, 8, 9, 10, 11]

    def ask(tokens: list[int], seed: int):
        params = T.SamplingParams(max_tokens=3, seed=seed)
        return sampler.sample(T.ModelInput.from_ints(tokens), 2, params).result()

    first, again, nxt = ask(prompt, 1), ask(prompt, 2), ask(turn2, 3)
    assert [r.prompt_cache_hit_tokens for r in (first, again, nxt)] == [0, 39, 40]
    sc.close("success").result(timeout=30)

    total = Api(server.url, "tml-metering").get("treadle/usage").json()["total"]
    sample = sum(len(s.tokens) for r in (first, again, nxt) for s in r.sequences)
    prefill, cached = 40 + 1 + 5, 39 + 40  # computed once per request; held by the cache
    assert (total["prefill_tokens"], total["cached_prefill_tokens"]) == (prefill, cached)
    cost = (prefill * 0.5 + cached * 0.1 + sample * 2.0) / 1e6
    assert total["cost_usd"] == pytest.approx(cost, rel=1e-9)
