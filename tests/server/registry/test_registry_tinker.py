"""The official tinker SDK's RestClient (0.38), unmodified, on the checkpoint routes: runs,
checkpoint listings, weights_info, TTL, deletion, and `tinker checkpoint download` (which
exports through save_weights_external and signed per-file URLs). The downloaded adapter is
judged by peft: it must give the trainer's logprobs.

    .venv/bin/python -m pytest -q tests/server/registry/test_registry_tinker.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
from tinker import types as T  # noqa: E402

API_KEY = "tml-treadle-tests"
TINY = "treadle/tiny-llama"


def datums(seed: int, n: int = 2, length: int = 10) -> list[T.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seq = rng.integers(3, 300, length + 1).tolist()
        out.append(
            T.Datum(
                model_input=T.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * length},
            )
        )
    return out


def test_rest_client_runs_checkpoints_download_and_delete(treadle_server, tiny_model_dir, tmp_path):
    svc = tinker.ServiceClient(base_url=treadle_server.url, api_key=API_KEY)
    tc = svc.create_lora_training_client(base_model=TINY, rank=4).result()
    tc.forward_backward(datums(0), "cross_entropy").result()
    tc.optim_step(T.AdamParams(learning_rate=0.05)).result()
    state = tc.save_state("rest-state", user_metadata={"k": "v"}).result().path
    sampler = tc.save_weights_for_sampler("rest-sampler").result().path
    probe = datums(9)
    expected = [
        o["logprobs"].to_numpy()
        for o in tc.forward(probe, "cross_entropy").result().loss_fn_outputs
    ]

    rest = tinker.RestClient(base_url=treadle_server.url, api_key=API_KEY)
    run_id = T.ParsedCheckpointTinkerPath.from_tinker_path(state).training_run_id
    runs = rest.list_training_runs(limit=100).result()
    assert run_id in [r.training_run_id for r in runs.training_runs]
    run = rest.get_training_run_by_tinker_path(state).result()
    assert run.base_model == TINY and run.lora_rank == 4
    assert run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint.tinker_path == sampler

    listed = rest.list_checkpoints(run_id).result().checkpoints
    by_path = {c.tinker_path: c for c in listed}
    assert by_path[state].checkpoint_type == "training"
    assert by_path[state].checkpoint_id == "weights/rest-state"
    assert by_path[state].user_metadata == {"k": "v"} and by_path[state].size_bytes > 0
    assert by_path[sampler].checkpoint_type == "sampler"
    assert state in [
        c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints
    ]

    info = rest.get_weights_info_by_tinker_path(state).result()
    assert info.base_model == TINY and info.lora_rank == 4 and info.is_lora
    rest.set_checkpoint_ttl_from_tinker_path(state, 7200).result()

    # `tinker checkpoint download`: a new run from the state, an external export, signed
    # URLs per file, the files, and the export deleted again
    env = {**os.environ, "TINKER_BASE_URL": treadle_server.url, "TINKER_API_KEY": API_KEY}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tinker.cli",
            "checkpoint",
            "download",
            state,
            "--output",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (folder / "adapter_config.json").is_file()
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, folder).eval()
    with torch.no_grad():
        for d, exp in zip(probe, expected, strict=True):
            logits = model(input_ids=torch.tensor([d.model_input.to_ints()])).logits[0]
            targets = torch.tensor(d.loss_fn_inputs["target_tokens"].to_numpy())
            got = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0]
            np.testing.assert_allclose(got.numpy(), exp, atol=2e-3)

    # an age-encrypted export (what tinker_cookbook.weights.download asks for): every file
    # is <name>.age, readable with the identity only
    pyrage = pytest.importorskip("pyrage")
    identity = pyrage.x25519.Identity.generate()
    export = tc.save_weights_external("aged", age_encryption_recipients=[str(identity.to_public())])
    urls = rest.get_external_weights_urls(export.result().path).result().urls
    assert urls and all(name.endswith(".age") for name in urls)
    aged = tmp_path / "aged"
    aged.mkdir()
    for name, url in urls.items():
        with urllib.request.urlopen(url, timeout=60) as resp:
            blob = resp.read()
        assert b"lora_A" not in blob
        (aged / name.removesuffix(".age")).write_bytes(pyrage.decrypt(blob, [identity]))
    assert (aged / "adapter_model.safetensors").read_bytes() == (
        folder / "adapter_model.safetensors"
    ).read_bytes()

    # the temporary export is gone; deleting a checkpoint removes it from the listings
    exports = [
        c
        for c in rest.list_user_checkpoints(limit=1000).result().checkpoints
        if c.checkpoint_type == "external"
    ]
    assert not [c for c in exports if c.checkpoint_id == "external_weights/download"]
    rest.delete_checkpoint_from_tinker_path(sampler).result()
    assert sampler not in [
        c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints
    ]
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(sampler).result()
    svc.close("success").result()


def test_single_user_server_publishes_into_a_server_folder(treadle_server, tmp_path):
    from treadle import ServiceClient

    out = tmp_path / "published"
    svc = ServiceClient(
        base_url=treadle_server.url,
        api_key=API_KEY,
        model_package_group="dev",
        output_path=str(out),
    )
    tc = svc.create_lora_training_client(TINY, rank=2)
    tc.save_state("dev-state").result(120)
    (version,) = svc.checkpoints.list_versions("dev")
    assert version.kind == "state" and version.path.startswith(str(out))
    assert (tmp_path / "published" / "default" / "dev").is_dir()
    assert {"adapter_model.safetensors", "treadle_state.json", "manifest.json"} <= {
        p.name for p in (out / "default" / "dev").rglob("*")
    }
    # the official SDK resumes from a version reference too
    sc = tinker.ServiceClient(base_url=treadle_server.url, api_key=API_KEY)
    resumed = sc.create_training_client_from_state_with_optimizer("dev:latest").result()
    assert resumed.get_info().model_data.model_name == TINY
    sc.close("success").result()
    svc.close()
