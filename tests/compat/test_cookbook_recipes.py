"""tinker-cookbook recipes (0.5.8, and the current 0.6.1), unmodified, against a real
`treadle serve`.

Each recipe runs in the cookbook's own virtualenv as a child process, configured only through
its command-line keys and environment variables (see conftest.py); nothing of the cookbook is
patched, registered or wrapped. The tiny model is served as `treadle/tiny-llama`; its ChatML
template is what the cookbook's `qwen3_instruct` renderer writes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

RENDERER = "qwen3_instruct"
COMMON = [f"renderer_name={RENDERER}", "lora_rank=8", "behavior_if_log_dir_exists=delete"]


def metrics_of(log_path: Path) -> list[dict]:
    """The cookbook's metrics.jsonl, one dict per logged step."""
    lines = (log_path / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat(user: str, assistant: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def test_renderer_matches_the_tiny_models_chat_template(run_cookbook, treadle_server):
    """The documented renderer choice: qwen3_instruct writes the tiny model's ChatML exactly
    (the tokenizer is loaded by name, offline, from the cache `treadle hf-cache` filled)."""
    script = f"""
from tinker_cookbook import renderers
from tinker_cookbook.tokenizer_utils import get_tokenizer
tok = get_tokenizer({treadle_server.model_name!r})
r = renderers.get_renderer({RENDERER!r}, tok)
msgs = [{{"role": "user", "content": "What is 4 + 5?"}}, {{"role": "assistant", "content": "9"}}]
prompt = r.build_generation_prompt(msgs[:1]).to_ints()
want = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False)
assert prompt == tok.encode(want, add_special_tokens=False), (tok.decode(prompt), want)
full, weights = r.build_supervised_example(msgs)
# the template ends each message with a newline; Qwen renderers put it in the next header
want = tok.apply_chat_template(msgs, tokenize=False).removesuffix("\\n")
assert tok.decode(full.to_ints()) == want, (tok.decode(full.to_ints()), want)
assert r.get_stop_sequences() == [tok.convert_tokens_to_ids("<|im_end|>")]
print("RENDERER-OK")
"""
    assert "RENDERER-OK" in run_cookbook("-c", script)


def test_supervised_jsonl_loss_falls(run_cookbook, tmp_path, treadle_server):
    rows = [
        {"messages": chat(u, a)}
        for u, a in [
            ("What is 2 + 3?", "2 + 3 = 5."),
            ("What is 7 + 1?", "7 + 1 = 8."),
            ("Hello!", "Hi! How can I help you today?"),
            ("Thank you.", "You are welcome!"),
        ]
    ]
    data = write_jsonl(tmp_path / "conversations.jsonl", rows)
    log = tmp_path / "sl"
    # one batch holding every conversation, three epochs: each step sees the same batch,
    # so its loss (measured before the step's update) falls only if training works
    run_cookbook(
        "-m", "tinker_cookbook.recipes.chat_sl.train",
        f"model_name={treadle_server.model_name}", f"dataset={data}", f"log_path={log}",
        "batch_size=4", "num_epochs=3", "max_steps=3", "learning_rate=5e-3", "max_length=128",
        "save_every=0", "eval_every=0", "infrequent_eval_every=0", *COMMON,
    )  # fmt: skip
    nll = [m["train_mean_nll"] for m in metrics_of(log) if "train_mean_nll" in m]
    assert len(nll) == 3 and all(math.isfinite(x) for x in nll)
    assert nll[0] > nll[1] > nll[2], nll
    final = json.loads((log / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert final["state_path"].startswith("tinker://") and "/weights/" in final["state_path"]


def test_math_rl_arithmetic_importance_sampling(run_cookbook, tmp_path, treadle_server):
    log = tmp_path / "rl"
    run_cookbook(
        "-m", "tinker_cookbook.recipes.math_rl.train",
        f"model_name={treadle_server.model_name}", "env=arithmetic", f"log_path={log}",
        "loss_fn=importance_sampling", "group_size=4", "groups_per_batch=2", "max_tokens=6",
        "learning_rate=1e-3", "max_steps=2", "save_every=0", "eval_every=0", *COMMON,
    )  # fmt: skip
    steps = [m for m in metrics_of(log) if "env/all/total_episodes" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["env/all/total_episodes"] == 8
        assert 1 <= m["env/all/ac_tokens_per_turn"] <= 6
        # the trainer's logprobs of the sampled tokens match the sampler's: same weights
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m


def test_math_rl_061_default_loss(run_cookbook, next_cookbook, tmp_path, treadle_server):
    """0.6.1's math_rl as it ships: its default loss, stable_reinforce, samples with
    record_stability_info and trains on provenance spans naming the recorded sequences."""
    log = tmp_path / "rl-061"
    version = run_cookbook(
        "-c", "import tinker_cookbook; print('COOKBOOK', tinker_cookbook.__version__)",
        path=next_cookbook,
    )  # fmt: skip
    assert "COOKBOOK 0.6.1" in version, version
    run_cookbook(
        "-m", "tinker_cookbook.recipes.math_rl.train",
        f"model_name={treadle_server.model_name}", "env=arithmetic", f"log_path={log}",
        "group_size=4", "groups_per_batch=2", "max_tokens=6", "learning_rate=1e-3",
        "max_steps=2", "save_every=0", "eval_every=0", *COMMON,
        path=next_cookbook,
    )  # fmt: skip
    config = json.loads((log / "config.json").read_text())
    assert config["loss_fn"] == "stable_reinforce", config.get("loss_fn")
    steps = [m for m in metrics_of(log) if "env/all/total_episodes" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["env/all/total_episodes"] == 8
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m


RL_LIBRARY = """
import asyncio, chz
from tinker_cookbook.rl import train
def run(config: train.Config) -> None:
    asyncio.run(train.main(config))
chz.nested_entrypoint(run)
"""


def test_rl_kl_penalty_against_the_base_model(run_cookbook, tmp_path, treadle_server):
    """The KL penalty scores sampled tokens with a base-model sampler's prompt logprobs. The
    math_rl CLI has no key for its reference model, so the library Config is set directly."""
    name, log = treadle_server.model_name, tmp_path / "kl"
    builder = "tinker_cookbook.recipes.math_rl.arithmetic_env:ArithmeticDatasetBuilder"
    run_cookbook(
        "-c", RL_LIBRARY,
        "recipe_name=kl", f"log_path={log}", f"model_name={name}", f"renderer_name={RENDERER}",
        "lora_rank=4", "learning_rate=1e-2", "max_tokens=6", "max_steps=2", "eval_every=0",
        "save_every=0", "loss_fn=importance_sampling", "kl_penalty_coef=0.1",
        f"kl_reference_config.base_model={name}", f"dataset_builder={builder}",
        "dataset_builder.batch_size=2", "dataset_builder.group_size=2",
        "dataset_builder.n_batches=2", f"dataset_builder.model_name_for_tokenizer={name}",
        f"dataset_builder.renderer_name={RENDERER}",
    )  # fmt: skip
    kl = [m["kl_policy_base"] for m in metrics_of(log) if "kl_policy_base" in m]
    assert len(kl) == 2
    # before any update the policy is the base model: its sampler and the reference agree
    # (to float rounding: 0-8e-8 in seven runs); after one (lr 1e-2) they differ.
    # kl_policy_base is a sample estimate (the mean log-ratio of 4 x 6 sampled tokens, not
    # seeded), so after the update neither its sign nor its size is fixed: 3e-4 to 0.14 in
    # seven runs, its terms of either sign cancelling more or less.
    assert abs(kl[0]) < 1e-6 and abs(kl[1]) > 1e-5, kl


def test_dpo_forward_backward_custom(run_cookbook, tmp_path, treadle_server):
    def pref(q: str, good: str, bad: str) -> dict:
        return {
            "comparison": {
                "prompt_conversation": [{"role": "user", "content": q}],
                "completion_A": [{"role": "assistant", "content": good}],
                "completion_B": [{"role": "assistant", "content": bad}],
            },
            "label": "A",
        }

    data = write_jsonl(
        tmp_path / "prefs.jsonl",
        [pref("What is 2 + 3?", "5", "7"), pref("What is 6 + 2?", "8", "3")],
    )
    log = tmp_path / "dpo"
    name = treadle_server.model_name
    # The DPO recipe's CLI only knows its Hugging Face datasets; its library Config takes the
    # cookbook's own JSONL comparison builder, set from the command line through chz.
    entry = "import chz; from tinker_cookbook.preference import train_dpo; chz.nested_entrypoint(train_dpo.main)"
    run_cookbook(
        "-c", entry,
        f"log_path={log}", f"model_name={name}", "recipe_name=dpo", f"renderer_name={RENDERER}",
        "lora_rank=8", "learning_rate=1e-2", "num_epochs=2", "max_steps=2", "save_every=0",
        "eval_every=0", "infrequent_eval_every=0",
        "dataset_builder=tinker_cookbook.preference.dpo_datasets:DPODatasetBuilderFromComparisons",
        f"dataset_builder.common_config.model_name_for_tokenizer={name}",
        f"dataset_builder.common_config.renderer_name={RENDERER}",
        "dataset_builder.common_config.max_length=128",
        "dataset_builder.common_config.batch_size=2",
        "dataset_builder.comparison_builder=tinker_cookbook.preference.preference_datasets:ComparisonBuilderFromJsonl",
        f"dataset_builder.comparison_builder.train_path={data}",
    )  # fmt: skip
    steps = [m for m in metrics_of(log) if "dpo_loss" in m]
    assert len(steps) == 2
    # step 0: the policy is its reference, so the sampler's reference logprobs must equal the
    # trainer's logprobs and the loss is -log sigmoid(0) = ln 2 exactly
    assert abs(steps[0]["dpo_loss"] - math.log(2)) < 1e-4, steps[0]
    assert abs(steps[0]["margin"]) < 1e-4
    # step 1 trains on the same pairs after one update: chosen answers gained on rejected ones
    assert steps[1]["dpo_loss"] < math.log(2) and steps[1]["margin"] > 0, steps[1]


DOWNLOAD = """
import json, sys
import tinker
from tinker_cookbook import weights
sc = tinker.ServiceClient()
tc = sc.create_lora_training_client(base_model=sys.argv[1], rank=4, seed=0).result()
datum = tinker.Datum(
    model_input=tinker.ModelInput.from_ints([5, 17, 33, 2, 40]),
    loss_fn_inputs={"target_tokens": [17, 33, 2, 40, 41], "weights": [1.0] * 5},
)
tc.forward_backward([datum], "cross_entropy").result()
tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
lps = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
path = tc.save_weights_external("export").result().path
weights.download(tinker_path=path, output_dir=sys.argv[2])
sc.close("success").result()
print("RESULT " + json.dumps({"path": path, "logprobs": lps}))
"""


def test_weights_download_of_an_external_export(run_cookbook, tmp_path, treadle_server):
    """tinker_cookbook.weights.download fetches save_weights_external's files through the
    RestClient's signed URLs; the adapter it writes loads in peft and scores like the trainer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    log = run_cookbook("-c", DOWNLOAD, treadle_server.model_name, str(out))
    result = json.loads(log.split("RESULT ", 1)[1].splitlines()[0])
    assert "/external_weights/" in result["path"]
    base = AutoModelForCausalLM.from_pretrained(treadle_server.models[treadle_server.model_name])
    model = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 17, 33, 2, 40]])).logits[0].float()  # (T, V)
    lp = logits.log_softmax(-1).gather(-1, torch.tensor([17, 33, 2, 40, 41])[:, None])[:, 0]
    assert torch.allclose(lp, torch.tensor(result["logprobs"]), atol=2e-4)
