"""The /v1 routes on a server with tenants: keys are required, another tenant's training
model, sampler, checkpoint and version are not found (and not listed), and every call is
metered to its caller's tenant exactly as its own `usage` says.

    .venv/bin/python -m pytest -q tests/acceptance/test_openai_tenants.py
"""

from __future__ import annotations

import httpx
import pytest
from _tenancy import TINY, make_tenants, start_server

from treadle import ServiceClient

openai = pytest.importorskip("openai")

WAIT = 120
CHAT = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("openai-tenants")
    keys = make_tenants(data, {"alice": None, "bob": None})
    srv = start_server({TINY: tiny_model_dir}, data, None)
    srv.keys = keys
    yield srv
    srv.stop()


def _client(server, who: str):
    key = server.keys[who]
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=WAIT)


def _usage(server, who: str) -> dict:
    headers = {"X-API-Key": server.keys[who]}
    resp = httpx.get(f"{server.url}/api/v1/treadle/usage", headers=headers, timeout=WAIT)
    assert resp.status_code == 200, resp.text
    return resp.json()["total"]


def test_tenants_are_isolated_authenticated_and_metered(server):
    alice, bob = _client(server, "alice"), _client(server, "bob")
    with ServiceClient(base_url=server.url, api_key=server.keys["alice"]) as svc:
        tc = svc.create_lora_training_client(TINY, rank=4, model_package_group="alice-pkg")
        sampler = tc.save_weights_and_get_sampling_client()
        path = tc.save_weights_for_sampler("mine").result(WAIT).path
        theirs = [tc.model_id, sampler.sampling_session_id, path, "alice-pkg:latest"]
        fakes = [
            f"{'0' * 16}:train:0",
            "0" * 16,
            path.replace(path.split("/")[2], "0" * len(path.split("/")[2])),
            "nobody-pkg:latest",
        ]
        kw = dict(messages=CHAT, max_tokens=5, seed=1)

        before = _usage(server, "alice")
        answers = [alice.chat.completions.create(model=m, **kw) for m in theirs]
        after = _usage(server, "alice")
        # metered through the Service, to the caller's tenant, token for token
        assert after["prefill_tokens"] - before["prefill_tokens"] == sum(
            a.usage.prompt_tokens for a in answers
        )
        assert after["sample_tokens"] - before["sample_tokens"] == sum(
            a.usage.completion_tokens for a in answers
        )

        bob_before = _usage(server, "bob")
        for model, fake in zip(theirs, fakes, strict=True):
            with pytest.raises(openai.NotFoundError) as got:
                bob.chat.completions.create(model=model, **kw)
            with pytest.raises(openai.NotFoundError) as missing:
                bob.chat.completions.create(model=fake, **kw)
            # nothing tells bob that alice's exists: the same answer as for no such thing
            assert got.value.body["code"] == "model_not_found", model
            message = got.value.body["message"].replace(model, fake)
            message = message.replace(model.split(":")[0], fake.split(":")[0])  # a group name
            assert message == missing.value.body["message"], model
            bob_key = {"X-API-Key": server.keys["bob"]}
            got_r, missing_r = (
                httpx.get(f"{server.url}/v1/models/{m}", headers=bob_key, timeout=WAIT)
                for m in (model, fake)
            )
            assert got_r.status_code == missing_r.status_code == 404, (model, got_r.text)
        assert alice.models.retrieve(tc.model_id).root == TINY
        listed = " ".join(m.id for m in bob.models.list())
        assert TINY in listed and all(m not in listed for m in theirs[:3])
        assert tc.model_id in [m.id for m in alice.models.list()]
        assert _usage(server, "bob") == bob_before  # refused calls cost nothing

        resp = httpx.post(f"{server.url}/v1/chat/completions", json={"model": TINY, **kw})
        assert resp.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"{server.url}/v1", api_key="tml-wrong", max_retries=0
            ).models.list()
        tc.stop()
