"""Capture sessions against a real server on the tiny model, with two tenants: an agent's
completions through the `openai` and `anthropic` clients are recorded token-exactly, rewarded
and exported as datums that forward_backward accepts (stable_reinforce's provenance too).

Independent checks: the token ids and logprobs each response returned (return_token_ids,
logprobs), and the chat template rendered here with transformers; a datum's trained tokens
must be exactly the tokens served, never a re-tokenization of their text.

    .venv/bin/python -m pytest -q tests/server/api/test_capture_sessions.py
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from _tenancy import TINY, make_tenants, start_server

from treadle import ServiceClient
from treadle.client.capture import CaptureSession
from treadle.client.errors import APIError

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

WAIT = 120
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("capture")
    keys = make_tenants(data, {"alice": None, "bob": None})
    srv = start_server({TINY: tiny_model_dir}, data, None)
    srv.keys = keys
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def alice(server):
    with ServiceClient(base_url=server.url, api_key=server.keys["alice"]) as svc:
        yield svc


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def agent(server, who: str, headers: dict):
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=server.keys[who], default_headers=headers,
        max_retries=0, timeout=WAIT,
    )  # fmt: skip


def two_turns(client, model: str, seed: int) -> list:
    """A two-turn conversation, as an agent runs it: → the two responses."""
    messages = [{"role": "user", "content": "Count to three."}]
    kw = dict(model=model, max_tokens=12, logprobs=True, extra_body=IDS)
    first = client.chat.completions.create(messages=messages, seed=seed, **kw)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    second = client.chat.completions.create(messages=messages, seed=seed + 1, **kw)
    return [first, second]


def served(r) -> tuple[list[int], list[int], list[float]]:
    extra = r.model_extra
    c = r.choices[0]
    return (
        extra["prompt_token_ids"],
        c.model_extra["token_ids"],
        [e.logprob for e in c.logprobs.content],
    )


def trained_tokens(datums) -> list[int]:
    """The targets a datum trains on (weight 1), in order, over all datums."""
    out = []
    for d in datums:
        targets = d.loss_fn_inputs["target_tokens"].to_numpy()
        weights = d.loss_fn_inputs["weights"].to_numpy()
        out += targets[weights > 0].tolist()
    return out


def test_exported_datums_are_the_tokens_served(server, alice, tok):
    tc = alice.create_lora_training_client(TINY, rank=8, seed=1)
    capture = alice.create_capture_session()
    runs = {}
    for g in range(2):
        client = agent(server, "alice", capture.headers(f"rollout-{g}"))
        runs[f"rollout-{g}"] = two_turns(client, tc.model_id, seed=10 * g)
    records = capture.completions()
    assert len(records) == 4
    for rec, r in zip(records, [r for rs in runs.values() for r in rs], strict=True):
        prompt, tokens, logprobs = served(r)
        assert rec["prompt_tokens"] == prompt and rec["tokens"] == tokens
        np.testing.assert_allclose(rec["logprobs"], logprobs, atol=1e-6)
        assert rec["sampler_version"] == f"{tc.model_id}@step:0"
        assert rec["sequence_id"] is not None  # a training session's weights: recorded
    capture.set_rewards([("rollout-0", 1.0, "q"), ("rollout-1", 0.0, "q")])
    datums, summary = capture.export()
    assert [s["advantage"] for s in summary] == [0.5, -0.5]  # reward - the group's mean
    by_traj = {}
    for s in summary:
        by_traj[s["trajectory_id"]] = datums[: s["datums"]]
        datums = datums[s["datums"] :]
    drift = []
    for tid, responses in runs.items():
        mine = by_traj[tid]
        served_tokens = [t for r in responses for t in served(r)[1]]
        assert trained_tokens(mine) == served_tokens  # no re-tokenization drift
        text = "".join(r.choices[0].message.content or "" for r in responses)
        drift.append(tok.encode(text, add_special_tokens=False) != served_tokens)
        lps = [
            x
            for d in mine
            for x in d.loss_fn_inputs["logprobs"].to_numpy()[
                d.loss_fn_inputs["weights"].to_numpy() > 0
            ]
        ]
        np.testing.assert_allclose(lps, [lp for r in responses for lp in served(r)[2]], atol=1e-6)
        # turn 2's prompt extends turn 1 exactly when the template re-renders its answer
        # as the very tokens sampled; then the two turns are one datum
        p1, s1, _ = served(responses[0])
        p2, _, _ = served(responses[1])
        chained = p2[: len(p1) + len(s1)] == p1 + s1
        assert len(mine) == (1 if chained else 2)
        for d in mine:  # prompts and the user's turns are in the datum, masked out
            w = d.loss_fn_inputs["weights"].to_numpy()
            adv = d.loss_fn_inputs["advantages"].to_numpy()
            assert set(np.unique(adv[w > 0])) == {0.5 if tid == "rollout-0" else -0.5}
            assert not adv[w == 0].any()
    # the random model's answers do not survive a decode and encode: an export that
    # tokenized the text again would have failed above
    assert any(drift)
    # forward_backward takes them: stable_reinforce checks their provenance on the server
    all_datums = capture.export_datums()
    for loss in ("importance_sampling", "stable_reinforce"):
        out = tc.forward_backward(all_datums, loss_fn=loss).result(WAIT)
        assert np.isfinite(out.metrics["loss:sum"])
    # a datum whose trained token is not the one recorded is refused by provenance
    bad = all_datums[0].model_copy(deep=True)
    targets = bad.loss_fn_inputs["target_tokens"].to_numpy().copy()
    k = int(np.flatnonzero(bad.loss_fn_inputs["weights"].to_numpy())[0])
    targets[k] = (targets[k] + 1) % len(tok)
    bad.loss_fn_inputs["target_tokens"] = bad.loss_fn_inputs["target_tokens"].from_numpy(targets)
    with pytest.raises(APIError, match="names token"):
        tc.forward_backward([bad], loss_fn="stable_reinforce").result(WAIT)


def test_anthropic_and_streamed_requests_are_captured(server, alice, tok):
    capture = alice.create_capture_session("agent-anthropic")
    client = anthropic.Anthropic(
        base_url=server.url, api_key=server.keys["alice"], max_retries=0,
        default_headers=capture.headers("a"),
    )  # fmt: skip
    msgs = [{"role": "user", "content": "Hello"}]
    whole = client.messages.create(model=TINY, max_tokens=10, messages=msgs, extra_body={"seed": 4})
    events = list(
        client.messages.create(
            model=TINY, max_tokens=10, messages=msgs, stream=True, extra_body={"seed": 4}
        )
    )
    oai = agent(server, "alice", capture.headers("b"))
    chunks = list(
        oai.chat.completions.create(model=TINY, messages=msgs, max_tokens=10, seed=4, stream=True)
    )
    recs = capture.completions()
    assert [r["trajectory_id"] for r in recs] == ["a", "a", "b"]
    want = tok.encode(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    for r in recs:
        assert r["prompt_tokens"] == want
        assert r["sequence_id"] is None  # a base model: no session keeps its sequences
        assert r["sampler_version"] == TINY
    assert recs[0]["tokens"] == recs[1]["tokens"] == recs[2]["tokens"]  # one seed
    assert len(recs[0]["tokens"]) == whole.usage.output_tokens
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.content[0].text if whole.content else text == ""
    with pytest.raises(openai.BadRequestError, match="n: a request under X-Treadle-Capture"):
        oai.chat.completions.create(model=TINY, messages=msgs, max_tokens=2, n=2)


def test_another_tenant_cannot_read_or_reward_a_capture(server, alice):
    capture = alice.create_capture_session("shared-name")
    agent(server, "alice", capture.headers("t")).chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    capture.set_reward("t", 1.0)
    with ServiceClient(base_url=server.url, api_key=server.keys["bob"]) as bob:
        with pytest.raises(APIError) as e:  # a name bob never used: not found
            CaptureSession(bob.transport, "cap-of-nobody").completions()
        assert e.value.status_code == 404
        # the same name is bob's own, empty capture: nothing of alice's is in it
        his = bob.create_capture_session("shared-name")
        assert his.completions() == []
        with pytest.raises(APIError) as e:
            his.set_reward("t", 5.0)  # alice's trajectory is unknown in bob's capture
        assert e.value.status_code == 404
        assert his.export_datums() == []
    raw = httpx.get(
        f"{server.url}/api/v1/treadle/captures/shared-name/completions",
        headers={"X-API-Key": server.keys["bob"]},
    )
    assert raw.status_code == 200 and raw.json()["completions"] == []
    # alice's reward is untouched
    (summary,) = capture.export()[1]
    assert summary["reward"] == 1.0


def test_captures_survive_a_restart(tiny_model_dir, tmp_path):
    data = tmp_path / "data"
    keys = make_tenants(data, {"alice": None})
    srv = start_server({TINY: tiny_model_dir}, data, None)
    try:
        with ServiceClient(base_url=srv.url, api_key=keys["alice"]) as svc:
            capture = svc.create_capture_session("durable")
            client = openai.OpenAI(
                base_url=f"{srv.url}/v1", api_key=keys["alice"], max_retries=0,
                default_headers=capture.headers("t"),
            )  # fmt: skip
            r = client.chat.completions.create(
                model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                seed=1, extra_body=IDS,
            )  # fmt: skip
            capture.set_reward("t", 1.0)
    finally:
        srv.stop()
    srv = start_server({TINY: tiny_model_dir}, data, None)
    try:
        with ServiceClient(base_url=srv.url, api_key=keys["alice"]) as svc:
            again = CaptureSession(svc.transport, "durable")
            (rec,) = again.completions()
            assert rec["tokens"] == r.choices[0].model_extra["token_ids"]
            datums, (summary,) = again.export()
            assert summary["reward"] == 1.0 and trained_tokens(datums) == rec["tokens"]
    finally:
        srv.stop()
