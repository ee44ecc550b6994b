"""The published training-session example, GSM8K GRPO with the three clients, run as written.

`run_published_loop` is the managed service's example loop word for word, apart from the
import line and the ServiceClient's constructor arguments (a base_url here, its region and
role there). It keeps its own argument names (model_package_group_arn, s3_output_path), its
`weights` mask next to the sampler logprobs and advantages under loss_fn="ppo", and its
unnamed saves; it must run 2 steps and leave sampler, merged and state versions in the group.

    .venv/bin/python -m pytest -q tests/client/test_published_loop.py
"""

from __future__ import annotations

import re

import pytest

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient

GROUP = "arn:aws:sagemaker:us-west-2:111122223333:model-package-group/gsm8k-grpo"
NAME = "gsm8k-grpo"
# A few GSM8K training problems (question, final answer): the example reads the dataset;
# the test server has no network, so they are inlined.
GSM8K = [
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
        "clips in May. How many clips did Natalia sell altogether in April and May?",
        "72",
    ),
    (
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
        "babysitting. How much did she earn?",
        "10",
    ),
    (
        "Betty is saving money for a new wallet which costs $100. Betty has only half of the "
        "money she needs. Her parents decided to give her $15 for that purpose, and her "
        "grandparents twice as much as her parents. How much more money does Betty need to "
        "buy the wallet?",
        "5",
    ),
]


# fmt: off
def run_published_loop(base_url: str, OUTPUT: str, steps: int = 2) -> None:
    svc = ServiceClient(base_url=base_url)
    training_client = svc.create_lora_training_client(
        "treadle/tiny-llama", training_session_name=NAME, rank=32, alpha=64,
        model_package_group_arn=GROUP, s3_output_path=OUTPUT)          # (a)
    tokenizer = training_client.get_tokenizer()
    params = SamplingParams(max_tokens=16, temperature=1.0)

    def reward(completion, answer):
        numbers = re.findall(r"-?\d+", completion.replace(",", ""))
        return 1.0 if numbers and numbers[-1] == answer else 0.0

    def build_training_datum(prompt, seq, advantage):                 # the user's helper
        tokens = prompt + seq.tokens
        n = len(prompt)
        return Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs={"target_tokens": tokens[1:],
                                     "logprobs": [0.0] * (n - 1) + seq.logprobs,
                                     "advantages": [0.0] * (n - 1) + [advantage] * len(seq.tokens),
                                     "weights": [0.0] * (n - 1) + [1.0] * len(seq.tokens)})   # (b)

    for step in range(steps):
        sampling_client = training_client.save_weights_and_get_sampling_client()
        prompts = [tokenizer.encode(f"Question: {q}\nAnswer:") for q, _ in GSM8K]
        futures = [sampling_client.sample(p, num_samples=4, sampling_params=params) for p in prompts]
        datums = []
        for prompt, (_, answer), future in zip(prompts, GSM8K, futures, strict=True):
            group = future.result().sequences
            rewards = [reward(tokenizer.decode(seq.tokens), answer) for seq in group]
            baseline = sum(rewards) / len(rewards)
            for seq, r in zip(group, rewards, strict=True):
                datums.append(build_training_datum(prompt, seq, r - baseline))
        fwd_bwd = training_client.forward_backward(datums, loss_fn="ppo")
        optim = training_client.optim_step(AdamParams(learning_rate=1e-5))
        print(f"step {step}: loss {fwd_bwd.result().metrics['loss:sum']:.4f}")
        optim.result()

    training_client.save_weights_for_sampler(merge_weights=True).result()   # (c) no name
    training_client.save_state().result()                                   # (c) no name
    training_client.stop()
# fmt: on


def test_published_loop_runs_as_written(server_url, tmp_path):
    output = str(tmp_path / "packages")  # a server folder: the test server is single-user
    run_published_loop(server_url, output)
    svc = ServiceClient(base_url=server_url)
    versions = svc.checkpoints.list_versions("gsm8k-grpo")  # the ARN's last path element
    assert {"sampler", "merged", "state"} <= {v.kind for v in versions}, versions
    named = {v.kind: v.name for v in versions if v.kind in ("merged", "state")}
    assert named == {"merged": "step-000002", "state": "step-000002"}, named
    svc.close()


def test_managed_service_settings_are_refused_by_name(server_url):
    for arg in ("role_arn", "region", "vpc_config"):
        with pytest.raises(TypeError, match=f"'{arg}' has no meaning on a self-hosted"):
            ServiceClient(base_url=server_url, **{arg: "x"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'rank_typo'"):
        ServiceClient(base_url=server_url, rank_typo=3)
    svc = ServiceClient(base_url=server_url, model_package_group_arn=GROUP)
    assert svc.model_package_group == "gsm8k-grpo"
    with pytest.raises(TypeError, match="'region' has no meaning"):
        svc.create_lora_training_client("treadle/tiny-llama", region="us-west-2")
    with pytest.raises(TypeError, match="name different groups"):
        svc.create_lora_training_client(
            "treadle/tiny-llama", model_package_group="a", model_package_group_arn=GROUP
        )
    svc.close()
