"""External-weights uploads against a real server (in this process): a PEFT adapter that peft
itself wrote (a LoRA on the tied lm_head included, with the base weight peft saves beside
it) goes up file by file through signed, expiring, single-use URLs, becomes a tinker://
checkpoint of its own that the official SDK samples from (with peft's numbers) and trains
on; a second use of a URL, a wrong size, an expired URL, a file that is not an adapter's,
weights that do not fit the model and another tenant's finish are refused, leaving nothing.

    .venv/bin/python -m pytest -q tests/server/api/test_external_uploads.py
"""

from __future__ import annotations

import time

import httpx
import pytest
import torch
from _tenancy import TINY, Api, make_tenants

tinker = pytest.importorskip("tinker")
peft = pytest.importorskip("peft")
from tinker import types as T  # noqa: E402

URL_TTL_S = 3
WAIT = 120
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from _inproc import InProcessServer

    data = tmp_path_factory.mktemp("uploads")
    keys = make_tenants(data, {"alice": None, "bob": None})
    config = {"upload_url_ttl_s": URL_TTL_S}
    with InProcessServer({TINY: tiny_model_dir}, data, config=config) as srv:
        srv.keys = keys
        yield srv


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    """A PEFT adapter as peft writes it, and peft's logprobs of PROMPT with it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False
    )
    model = peft.get_peft_model(base, config).eval()
    folder = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(folder)
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        logp = model(input_ids=ids).logits[0].float().log_softmax(-1)  # (T, V)
    want = [logp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    return folder, want


def upload(api: Api, folder, name: str, sizes: dict | None = None) -> dict:
    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    files = {k: v for k, v in files.items() if k != "README.md"}
    body = {"base_model": TINY, "name": name, "files": sizes or files}
    return api.ok("external_weights_upload_start", body)


def put_all(started: dict, folder) -> None:
    for file, url in started["urls"].items():
        resp = httpx.put(url, content=(folder / file).read_bytes(), timeout=WAIT)
        assert resp.status_code == 200, resp.text


def test_an_uploaded_adapter_samples_as_peft_and_trains(server, adapter):
    folder, want = adapter
    api = Api(server.url, server.keys["alice"])
    started = upload(api, folder, "peft-made")
    assert set(started["urls"]) == {"adapter_config.json", "adapter_model.safetensors"}
    put_all(started, folder)
    # each URL takes one body
    url = started["urls"]["adapter_config.json"]
    again = httpx.put(url, content=(folder / "adapter_config.json").read_bytes())
    assert again.status_code == 409 and "used already" in again.text
    bob = Api(server.url, server.keys["bob"])
    assert (
        bob.post("external_weights_upload_finish", {"upload_id": started["upload_id"]}).status_code
        == 404
    )
    bob.close()
    done = api.ok("external_weights_upload_finish", {"upload_id": started["upload_id"]})
    path = done["tinker_path"]
    assert path.startswith("tinker://") and path.endswith("/external_weights/peft-made")
    assert done["size_bytes"] > 0

    svc = tinker.ServiceClient(base_url=server.url, api_key=server.keys["alice"])
    try:
        sampler = svc.create_sampling_client(model_path=path).result()
        got = sampler.compute_logprobs(T.ModelInput.from_ints(PROMPT)).result(timeout=WAIT)
        assert got[0] is None
        assert got[1:] == pytest.approx(want, abs=2e-4)
        tc = svc.create_training_client_from_state(path).result()  # trains on from it
        datum = T.Datum(
            model_input=T.ModelInput.from_ints(PROMPT[:-1]),
            loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * 5},
        )
        fwd = tc.forward([datum], "cross_entropy").result(timeout=WAIT)
        assert fwd.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(want, abs=2e-4)
        tc.forward_backward([datum], "cross_entropy").result(timeout=WAIT)
        tc.optim_step(T.AdamParams(learning_rate=1e-3)).result(timeout=WAIT)
    finally:
        svc.close("success").result(timeout=30)
    api.close()


def test_bad_uploads_are_refused_and_leave_nothing(server, adapter, tmp_path):
    folder, _ = adapter
    api = Api(server.url, server.keys["alice"])
    uploads = server.data_dir / "uploads"
    # names: only a PEFT adapter folder's files, never a path
    bad = api.post(
        "external_weights_upload_start",
        {"base_model": TINY, "name": "x", "files": {"../../etc/passwd": 10}},
    )
    assert bad.status_code == 400 and "not a file of a PEFT adapter" in bad.text
    bad = api.post(
        "external_weights_upload_start",
        {"base_model": TINY, "name": "../x", "files": {"adapter_config.json": 1}},
    )
    assert bad.status_code == 400 and "name" in bad.text
    # a body of another size than declared
    started = upload(api, folder, "sizes")
    url = started["urls"]["adapter_config.json"]
    short = httpx.put(url, content=b"{}")
    assert short.status_code == 400 and "declared" in short.text
    # weights that are not this model's LoRA: refused at finish, and nothing stays
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_bytes((folder / "adapter_config.json").read_bytes())
    from safetensors.torch import save_file

    save_file({"base_model.model.nope.lora_A.weight": torch.zeros(4, 8)},
              str(broken / "adapter_model.safetensors"))  # fmt: skip
    started = upload(api, broken, "broken")
    put_all(started, broken)
    refused = api.post("external_weights_upload_finish", {"upload_id": started["upload_id"]})
    assert refused.status_code == 400 and "nope" in refused.text, refused.text
    assert not (uploads / started["upload_id"]).exists()
    again = api.post("external_weights_upload_finish", {"upload_id": started["upload_id"]})
    assert again.status_code == 404
    # an expired URL
    started = upload(api, folder, "late")
    time.sleep(URL_TTL_S + 0.5)
    late = httpx.put(started["urls"]["adapter_config.json"], content=b"x")
    assert late.status_code == 404 and "expired" in late.text
    # a forged URL
    forged = started["urls"]["adapter_config.json"][:-4] + "0000"
    assert httpx.put(forged, content=b"x").status_code == 404
    api.close()
