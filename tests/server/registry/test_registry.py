"""Model package groups end to end: a real `treadle serve` process, the treadle SDK, peft
and transformers as independent judges, and moto's S3 server as a real HTTP object store.

One server (in tenant mode: two tenants, A and B) serves every test of this module; the
tests use tenant A unless they check isolation.

    .venv/bin/python -m pytest -q tests/server/registry/test_registry.py
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from _s3 import moto_s3

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from treadle.artifacts import encryption
from treadle.client.errors import APIError, BadRequestError, NotFoundError
from treadle.client.transport import RetryPolicy
from treadle.launch import ServerProcess

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
boto3 = pytest.importorskip("boto3")
transformers = pytest.importorskip("transformers")

TINY = "treadle/tiny-llama"
BUCKET = "treadle-test"
ATOL = 2e-3  # service vs plain transformers/peft logprobs (same weights, fp32)
FAST_RETRY = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.1, deadline_s=20)


@pytest.fixture(scope="module")
def s3_endpoint():
    with moto_s3(BUCKET) as url:
        yield url


@pytest.fixture(scope="module")
def env(s3_endpoint, tiny_model_dir, tmp_path_factory):
    """The server (started with the S3 settings in its environment) and two tenants' keys."""
    tenants = pytest.importorskip("treadle.server.tenancy.tenants")
    from treadle.server.storage.database import Store

    data = tmp_path_factory.mktemp("registry-data")
    server = ServerProcess({TINY: tiny_model_dir}, data, startup_timeout_s=180).start()
    try:
        store = Store(f"sqlite:///{data / 'treadle.db'}")
        keys = {}
        for name in ("alice", "bob"):
            tenants.create_tenant(store, name)
            keys[name], _ = tenants.create_key(store, name)
        store.close()
        time.sleep(1.2)  # the server rechecks development mode every second
        yield {"server": server, "data": data, "keys": keys, "s3": s3_endpoint}
    finally:
        server.stop()


def client(env, tenant="alice", **kw) -> ServiceClient:
    return ServiceClient(
        base_url=env["server"].url, api_key=env["keys"][tenant], retry=FAST_RETRY, **kw
    )


def data_of(seed: int, n: int = 2, length: int = 10) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(3, 300, length).tolist()
        out.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "weights": np.ones(length - 1, np.float32),
                },
            )
        )
    return out


PROBE = data_of(99, n=2, length=12)


def train(tc, steps: int, seed: int = 0) -> None:
    for i in range(steps):
        tc.forward_backward(data_of(seed + i), "cross_entropy")
        tc.optim_step(AdamParams(learning_rate=0.05)).result(120)


def service_logprobs(tc) -> list[np.ndarray]:
    out = tc.forward(PROBE, "cross_entropy").result(120)
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def hf_logprobs(model) -> list[np.ndarray]:
    """Target-token logprobs of PROBE under a plain transformers / peft model."""
    out = []
    with torch.no_grad():
        for d in PROBE:
            ids = torch.tensor([d.model_input.to_ints()])
            logits = model(input_ids=ids).logits[0].float()  # (T, V)
            targets = torch.tensor(d.loss_fn_inputs["target_tokens"].to_numpy())
            lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
            out.append(lp.numpy())
    return out


def base_model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, torch_dtype=torch.float32
    ).eval()


def assert_close(a: list[np.ndarray], b: list[np.ndarray], atol: float = ATOL) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, atol=atol)


def test_every_save_is_a_version_and_exports_load_in_peft_and_transformers(
    env, tiny_model_dir, tmp_path
):
    svc = client(env, model_package_group="pkg")
    tc = svc.create_lora_training_client(TINY, rank=4, seed=1)
    train(tc, 2)
    sampler = tc.save_weights_for_sampler("s2", user_metadata={"note": "two"}, merge_weights=True)
    assert sampler.result(120).path.endswith("/sampler_weights/s2")
    tc.save_state("st2").result(120)
    expected = service_logprobs(tc)
    tc.save_weights_and_get_sampling_client()  # the per-step refresh is a version too

    versions = svc.checkpoints.list_versions("pkg")
    assert [(v.version, v.kind) for v in versions] == [
        (1, "sampler"),
        (2, "merged"),
        (3, "state"),
        (4, "sampler"),
    ]
    for v in versions:
        assert v.step == 2 and v.base_model == TINY and v.size_bytes > 0
        assert v.session_id == svc.session_id and v.model_id == tc.model_id
        assert not v.encrypted and Path(v.path).is_dir()
    assert versions[0].user_metadata == {"note": "two"} and versions[0].name == "s2"
    assert svc.checkpoints.get_version("pkg:latest").version == 4
    assert [g.name for g in svc.checkpoints.list_groups()] == ["pkg"]

    adapter = svc.checkpoints.download("pkg:1", tmp_path / "adapter")
    peft_model = peft.PeftModel.from_pretrained(base_model(tiny_model_dir), adapter).eval()
    assert_close(hf_logprobs(peft_model), expected)

    merged = svc.checkpoints.download("pkg:2", tmp_path / "merged")
    merged_model = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    assert_close(hf_logprobs(merged_model), expected)
    assert transformers.AutoTokenizer.from_pretrained(merged) is not None

    refresh = svc.checkpoints.download("pkg:4", tmp_path / "refresh")
    refresh_model = peft.PeftModel.from_pretrained(base_model(tiny_model_dir), refresh).eval()
    assert_close(hf_logprobs(refresh_model), expected)

    # a version samples like its trainer
    sc = svc.create_sampling_client("pkg:1")
    tokens = PROBE[0].model_input.to_ints() + [
        int(PROBE[0].loss_fn_inputs["target_tokens"].to_numpy()[-1])
    ]
    scored = sc.compute_logprobs(ModelInput.from_ints(tokens)).result(120)
    np.testing.assert_allclose(np.array(scored[1:], dtype=np.float32), expected[0], atol=ATOL)

    # resume from the state version: same weights, and the same next step (Adam moments)
    resumed = svc.create_training_client_from_state_with_optimizer("pkg:latest")
    assert_close(service_logprobs(resumed), expected, atol=1e-5)
    train(tc, 1, seed=50)
    train(resumed, 1, seed=50)
    assert_close(service_logprobs(resumed), service_logprobs(tc), atol=1e-5)
    # the resumed client publishes into the same group (the ServiceClient's default)
    resumed.save_state("after").result(120)
    assert svc.checkpoints.get_version("pkg:latest").model_id == resumed.model_id
    svc.close()


def test_import_a_peft_folder_and_a_version_of_another_group(env, tiny_model_dir, tmp_path):
    # an adapter made by peft itself, with nonzero B so that it changes the model
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    made = peft.get_peft_model(base_model(tiny_model_dir), cfg)
    with torch.no_grad():
        for name, p in made.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    made.save_pretrained(tmp_path / "ext")
    expected = hf_logprobs(made.eval())

    svc = client(env)
    tc = svc.create_training_client_from_state(
        str(tmp_path / "ext"), base_model=TINY, model_package_group="imported"
    )
    assert_close(service_logprobs(tc), expected)
    (imported,) = svc.checkpoints.list_versions("imported")
    assert imported.kind == "sampler" and imported.source is not None

    # a version of that group starts a client bound to another group
    tc2 = svc.create_training_client_from_state("imported:1", model_package_group="forked")
    assert_close(service_logprobs(tc2), expected)
    train(tc2, 1)
    tc2.save_weights_for_sampler("forked-1").result(120)
    (forked,) = svc.checkpoints.list_versions("forked")
    assert forked.model_id == tc2.model_id and forked.step == 1
    svc.close()


def test_retention_deletes_exactly_the_expected_versions(env):
    svc = client(env, model_package_group="ret")
    tc = svc.create_lora_training_client(TINY, rank=2)
    for i in range(4):
        tc.save_weights_for_sampler(f"s{i}").result(120)  # versions 1..4
    tc.save_state("old").result(120)  # version 5
    time.sleep(1.5)
    tc.save_state("new").result(120)  # version 6
    paths = {v.version: v.path for v in svc.checkpoints.list_versions("ret")}

    deleted = svc.checkpoints.set_retention("ret", keep_last=2, state_ttl_s=1.0)
    assert [v.version for v in deleted] == [1, 2, 5]
    kept = [v.version for v in svc.checkpoints.list_versions("ret")]
    assert kept == [3, 4, 6]
    for n, path in paths.items():
        assert Path(path).exists() == (n in kept)

    tc.save_weights_for_sampler("s4").result(120)  # version 7: the policy applies again
    assert [v.version for v in svc.checkpoints.list_versions("ret", kind="sampler")] == [4, 7]
    group = next(g for g in svc.checkpoints.list_groups() if g.name == "ret")
    assert group.keep_last == 2 and group.latest == 7
    svc.checkpoints.delete_version("ret:4")
    assert [v.version for v in svc.checkpoints.list_versions("ret")] == [6, 7]
    with pytest.raises(NotFoundError):
        svc.checkpoints.get_version("ret:4")
    svc.close()


def test_encrypted_versions_are_unreadable_without_the_key(env, tiny_model_dir, tmp_path):
    key = encryption.new_key()
    svc = client(env, model_package_group="secret", encryption_key=key)
    tc = svc.create_lora_training_client(TINY, rank=4, seed=3)
    train(tc, 1)
    path = tc.save_weights_for_sampler("enc").result(120).path
    tc.save_state("enc-state").result(120)
    expected = service_logprobs(tc)

    sampler, state = svc.checkpoints.list_versions("secret")
    assert sampler.encrypted and state.encrypted and sampler.key_id
    stored = (Path(sampler.path) / "adapter_model.safetensors").read_bytes()
    assert stored.startswith(encryption.MAGIC) and b"lora_A" not in stored
    with pytest.raises(ValueError):
        encryption.decrypt_bytes(
            encryption.parse_key(encryption.new_key()), "adapter_model.safetensors", stored
        )
    plain = encryption.decrypt_bytes(encryption.parse_key(key), "adapter_model.safetensors", stored)
    assert b"lora_A" in plain[:4096]  # the safetensors header, readable with the key
    # no plain copy stays on the server's disk
    run_dir = env["data"] / "artifacts" / path.split("/")[2]
    assert not list(run_dir.rglob("*.safetensors"))

    keyless = client(env)
    with pytest.raises(BadRequestError, match="encrypted"):
        keyless.checkpoints.download("secret:1", tmp_path / "nokey")
    wrong = client(env, encryption_key=encryption.new_key())
    with pytest.raises(BadRequestError, match="wrong key"):
        wrong.create_training_client_from_state_with_optimizer("secret:2")

    adapter = svc.checkpoints.download("secret:1", tmp_path / "adapter")
    peft_model = peft.PeftModel.from_pretrained(base_model(tiny_model_dir), adapter).eval()
    assert_close(hf_logprobs(peft_model), expected)
    resumed = svc.create_training_client_from_state_with_optimizer("secret:latest")
    assert_close(service_logprobs(resumed), expected, atol=1e-5)
    # a sampler straight from the encrypted version (by reference and by its tinker path)
    tokens = PROBE[0].model_input.to_ints() + [
        int(PROBE[0].loss_fn_inputs["target_tokens"].to_numpy()[-1])
    ]
    for ref in ("secret:1", path):
        scored = svc.create_sampling_client(ref).compute_logprobs(ModelInput.from_ints(tokens))
        got = np.array(scored.result(120)[1:], dtype=np.float32)
        np.testing.assert_allclose(got, expected[0], atol=ATOL)
    with pytest.raises(BadRequestError, match="encrypted"):
        keyless.create_sampling_client("secret:1")
    for c in (svc, keyless, wrong):
        c.close()


def test_s3_store_save_list_download_resume(env, tmp_path):
    prefix = f"s3://{BUCKET}/runs"
    svc = client(env, model_package_group="cloud", output_path=prefix)
    tc = svc.create_lora_training_client(TINY, rank=4, seed=5)
    train(tc, 1)
    tc.save_weights_for_sampler("c1").result(120)
    tc.save_state("c1-state").result(120)
    expected = service_logprobs(tc)

    sampler, state = svc.checkpoints.list_versions("cloud")
    assert sampler.path.startswith(prefix + "/") and state.kind == "state"
    s3 = boto3.client("s3", endpoint_url=env["s3"])
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]}
    sampler_key = sampler.path.removeprefix(f"s3://{BUCKET}/")
    assert {f"{sampler_key}/adapter_model.safetensors", f"{sampler_key}/manifest.json"} <= keys

    folder = svc.checkpoints.download("cloud:1", tmp_path / "c1")
    assert (folder / "adapter_config.json").is_file()
    resumed = svc.create_training_client_from_state_with_optimizer("cloud:2")
    assert_close(service_logprobs(resumed), expected, atol=1e-5)

    svc.checkpoints.delete_version("cloud:1")
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])}
    assert not any(k.startswith(sampler_key + "/") for k in keys)
    svc.close()


def test_a_failed_store_fails_the_save_and_registers_nothing(env):
    svc = client(env, model_package_group="broken", output_path="s3://no-such-bucket/x")
    tc = svc.create_lora_training_client(TINY, rank=2)
    with pytest.raises(APIError, match="no-such-bucket|NoSuchBucket"):
        tc.save_weights_for_sampler("lost").result(120)
    with pytest.raises(APIError):
        tc.save_state("lost-state").result(120)
    with pytest.raises(NotFoundError):
        svc.checkpoints.list_versions("broken")
    listed = svc.transport.call(
        svc.transport.get(f"/api/v1/training_runs/{tc.model_id}/checkpoints")
    )
    assert listed["checkpoints"] == []  # no tinker checkpoint the client was not told of
    assert service_logprobs(tc)  # the session goes on
    svc.close()


def test_tenants_never_see_each_others_versions(env, tmp_path):
    alice = client(env, model_package_group="private")
    tc = alice.create_lora_training_client(TINY, rank=2)
    tc.save_weights_for_sampler("mine").result(120)
    tc.save_state("mine-state").result(120)
    assert "private" in [g.name for g in alice.checkpoints.list_groups()]

    bob = client(env, tenant="bob")
    assert "private" not in [g.name for g in bob.checkpoints.list_groups()]
    for call in (
        lambda: bob.checkpoints.list_versions("private"),
        lambda: bob.checkpoints.get_version("private:1"),
        lambda: bob.checkpoints.download("private:1", tmp_path / "x"),
        lambda: bob.checkpoints.delete_version("private:1"),
        lambda: bob.checkpoints.set_retention("private", keep_last=1),
        lambda: bob.create_training_client_from_state("private:1", base_model=TINY),
        lambda: bob.create_training_client_from_state_with_optimizer("private:latest"),
    ):
        with pytest.raises(NotFoundError):
            call()
    # bob's group of the same name is his own
    tc_b = bob.create_lora_training_client(TINY, rank=2, model_package_group="private")
    tc_b.save_weights_for_sampler("his").result(120)
    assert [v.model_id for v in bob.checkpoints.list_versions("private")] == [tc_b.model_id]
    assert len(alice.checkpoints.list_versions("private")) == 2
    for c in (alice, bob):
        c.close()


def test_bad_arguments_are_named(env):
    svc = client(env)
    with pytest.raises(BadRequestError, match="model_package_group"):
        svc.create_lora_training_client(TINY, rank=2, model_package_group="no spaces")
    with pytest.raises(BadRequestError, match="output_path"):
        svc.create_lora_training_client(
            TINY, rank=2, model_package_group="ok", output_path="relative/dir"
        )
    # a tenant of a shared server may not make it write into any server folder
    with pytest.raises(BadRequestError, match="single-user"):
        svc.create_lora_training_client(
            TINY, rank=2, model_package_group="ok", output_path="/srv/elsewhere"
        )
    tc = svc.create_lora_training_client(TINY, rank=2)
    with pytest.raises(APIError, match="model_package_group"):
        tc.save_weights_for_sampler("m", merge_weights=True).result(120)
    with pytest.raises(NotFoundError):
        svc.create_training_client_from_state("nothere:1")
    svc.close()


def test_cli_lists_shows_downloads_retains(env, tmp_path, capsys):
    from treadle.cli import main

    svc = client(env, model_package_group="clig")
    tc = svc.create_lora_training_client(TINY, rank=2)
    for i in range(3):
        tc.save_weights_for_sampler(f"v{i}").result(120)
    common = ["checkpoints", "--base-url", env["server"].url, "--api-key", env["keys"]["alice"]]
    main([*common, "list"])
    assert "clig" in capsys.readouterr().out
    main([*common, "list", "clig"])
    out = capsys.readouterr().out
    assert "clig:1" in out and "clig:3" in out and "sampler" in out
    main([*common, "show", "clig:latest"])
    assert "version: 3" in capsys.readouterr().out
    main([*common, "download", "clig:2", str(tmp_path / "dl")])
    assert (tmp_path / "dl" / "adapter_model.safetensors").is_file()
    main([*common, "retain", "clig", "--keep-last", "1"])
    assert "clig:1, clig:2" in capsys.readouterr().out
    main([*common, "delete", "clig:3"])
    assert svc.checkpoints.list_versions("clig") == []
    shutil.rmtree(tmp_path / "dl")
    svc.close()


def test_a_sampler_of_an_s3_version_comes_back_after_a_kill(env):
    """Its version's files are fetched from S3 again when the server restarts (last in this
    module: it kills the module's server)."""
    svc = client(env, model_package_group="s3-sampler", output_path=f"s3://{BUCKET}/sampler")
    tc = svc.create_lora_training_client(TINY, rank=4, seed=1)
    train(tc, 3)
    tc.save_weights_for_sampler("s1").result(120)
    sampler = svc.create_sampling_client("s3-sampler:1")
    prompt, params = ModelInput.from_ints([5, 6, 7]), SamplingParams(max_tokens=6, temperature=0)
    before = sampler.sample(prompt, 1, params).result(120).sequences[0].tokens
    env["server"].kill()
    env["server"].start()
    assert sampler.sample(prompt, 1, params).result(120).sequences[0].tokens == before
    svc.close()
