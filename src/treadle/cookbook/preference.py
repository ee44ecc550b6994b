"""Preference alignment as custom losses over reference-model logprobs: DPO and KTO.

Both run through `forward_backward_custom`: the server returns the policy's per-token
logprobs, the loss below is differentiated here, and the gradient goes back as weights. The
reference is the policy as it was before training, sampled once per batch with
`compute_logprobs` on a frozen sampler.

DPO (pairs):    -log σ(β·[(π_c − ref_c) − (π_r − ref_r)])
KTO (labels):   λ_D·(1 − σ(β·(r − z0))) for desirable, λ_U·(1 − σ(β·(z0 − r))) for undesirable,
                with r = π − ref of the completion and z0 = the batch's mean r, clamped at 0
                and not differentiated (the KL reference point of the KTO paper).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from treadle import AdamParams, Datum, ModelInput
from treadle.cookbook.run_dir import RunDir, open_training_client, step_bar, step_rng
from treadle.cookbook.sft import chat_tokens


@dataclass
class PreferenceConfig:
    model: str
    run_dir: str
    base_url: str | None = None
    beta: float = 0.1
    desirable_weight: float = 1.0  # KTO λ_D
    undesirable_weight: float = 1.0  # KTO λ_U
    lora_rank: int = 32
    lora_alpha: float | None = None
    learning_rate: float = 1e-5
    batch_size: int = 16  # pairs (DPO) or examples (KTO) per step
    max_length: int = 512
    max_steps: int = 50
    save_every: int = 25
    seed: int = 0
    mlflow_uri: str | None = None
    wandb_project: str | None = None  # log to Weights & Biases too (tinker-cookbook's names)
    wandb_name: str | None = None


@dataclass
class Completion:
    """A prompt and one completion, as tokens; the loss reads only the completion's logprobs."""

    prompt: list[int]
    completion: list[int]

    def datum(self) -> Datum:
        tokens_T = self.prompt + self.completion
        weights_T = [0.0] * len(self.prompt) + [1.0] * len(self.completion)
        return Datum(
            model_input=ModelInput.from_ints(tokens_T[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(tokens_T[1:], dtype=np.int64),
                "weights": np.asarray(weights_T[1:], dtype=np.float32),
            },
        )


def render(tokenizer, prompt, completion: str, max_length: int) -> Completion:
    """`prompt` is a string (raw text) or a list of chat messages (chat template)."""
    if isinstance(prompt, str):
        prompt_T = tokenizer.encode(prompt, add_special_tokens=False)
        completion_T = tokenizer.encode(completion, add_special_tokens=False)
        completion_T.append(tokenizer.eos_token_id)
    else:
        prompt_T = chat_tokens(tokenizer, prompt, add_generation_prompt=True)
        full = chat_tokens(tokenizer, [*prompt, {"role": "assistant", "content": completion}])
        completion_T = full[len(prompt_T) :]
    keep = max(1, max_length - len(completion_T))
    return Completion(prompt_T[-keep:], completion_T[: max_length - 1])


# ---- losses (torch) -----------------------------------------------------------------------


def sequence_logprob(logprobs_T, weights_T):
    return (logprobs_T * weights_T).sum()


def dpo_loss(policy_c, policy_r, ref_c, ref_r, beta: float):
    """Mean DPO loss over pairs; inputs are (P,) completion logprob sums."""
    import torch.nn.functional as F

    margin = beta * ((policy_c - ref_c) - (policy_r - ref_r))
    return -F.logsigmoid(margin).mean(), margin


def kto_loss(policy, ref, desirable, beta: float, w_d: float = 1.0, w_u: float = 1.0):
    """Mean KTO loss; `desirable` is a (N,) bool tensor."""
    import torch

    ratio = policy - ref
    z0 = ratio.detach().mean().clamp(min=0)
    value = torch.where(
        desirable,
        w_d * (1 - torch.sigmoid(beta * (ratio - z0))),
        w_u * (1 - torch.sigmoid(beta * (z0 - ratio))),
    )
    return value.mean(), ratio


def make_loss_fn(loss: str, config: PreferenceConfig, ref, desirable, stats: dict):
    """The custom loss of one batch: (data, per-datum logprobs) -> (loss, metrics).
    Batch statistics for logging are written into `stats`."""
    import torch

    def loss_fn(data, logprobs_list):
        policy = torch.stack(
            [
                sequence_logprob(lp, d.loss_fn_inputs["weights"].to_torch())
                for d, lp in zip(data, logprobs_list, strict=True)
            ]
        )
        if loss == "dpo":
            value, margin = dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2], config.beta)
            stats.update(
                accuracy=float((margin > 0).float().mean()), margin=float(margin.detach().mean())
            )
        else:
            value, ratio = kto_loss(
                policy,
                ref,
                desirable,
                config.beta,
                config.desirable_weight,
                config.undesirable_weight,
            )
            stats.update(
                reward_desirable=_masked_mean(ratio.detach(), desirable),
                reward_undesirable=_masked_mean(ratio.detach(), ~desirable),
            )
        return value, {f"{loss}_loss": float(value)}

    return loss_fn


# ---- loop ---------------------------------------------------------------------------------


def _reference_sums(ref_client, completions: Sequence[Completion]) -> list[float]:
    futures = [ref_client.compute_logprobs(c.prompt + c.completion) for c in completions]
    sums = []
    for c, fut in zip(completions, futures, strict=True):
        lp = fut.result()
        sums.append(float(sum(x for x in lp[len(c.prompt) :] if x is not None)))
    return sums


def train_preference(
    config: PreferenceConfig,
    loss: str,
    examples: Sequence,
    service=None,
) -> RunDir:
    """`examples`: (chosen, rejected) Completion pairs for "dpo", (Completion, bool) for "kto"."""
    import torch

    from treadle import ServiceClient

    if loss not in ("dpo", "kto"):
        raise ValueError(f"loss must be 'dpo' or 'kto', got {loss!r}")
    run = RunDir(
        config.run_dir,
        {**config.__dict__, "loss": loss},
        mlflow_uri=config.mlflow_uri,
        wandb_project=config.wandb_project,
        wandb_name=config.wandb_name,
    )
    svc = service or ServiceClient(base_url=config.base_url)
    tc, start, last = open_training_client(
        svc, run, config.model, config.lora_rank, config.lora_alpha, config.seed
    )
    if last:
        reference_path = last["reference_path"]
    else:
        reference_path = tc.save_weights_for_sampler("reference").result().path
    reference = svc.create_sampling_client(model_path=reference_path)
    adam = AdamParams(learning_rate=config.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)
    bar = step_bar(loss, start, config.max_steps)
    for step in bar:
        t0 = time.monotonic()
        batch = step_rng(config.seed, step).sample(
            list(examples), min(config.batch_size, len(examples))
        )
        if loss == "dpo":
            completions = [c for pair in batch for c in pair]  # c0, r0, c1, r1, ...
        else:
            completions = [c for c, _ in batch]
        ref = torch.tensor(_reference_sums(reference, completions))
        desirable = torch.tensor([bool(label) for _, label in batch]) if loss == "kto" else None
        stats: dict[str, float] = {}
        loss_fn = make_loss_fn(loss, config, ref, desirable, stats)
        fwd_bwd = tc.forward_backward_custom([c.datum() for c in completions], loss_fn)
        optim = tc.optim_step(adam)
        out = fwd_bwd.result()
        optim.result()
        metrics = {f"train/{k.split(':')[0]}": v for k, v in out.metrics.items()}
        metrics |= {f"train/{k}": v for k, v in stats.items()}
        metrics["time/step_s"] = time.monotonic() - t0
        run.log_metrics(step, metrics)
        if config.save_every and (step + 1) % config.save_every == 0:
            state = tc.save_state(f"{loss}-{step + 1:06d}").result().path
            run.log_checkpoint(step + 1, state_path=state, reference_path=reference_path)
        bar.set_postfix(loss=f"{metrics.get(f'train/{loss}_loss', float('nan')):.4f}")
    run.close()
    return run


def _masked_mean(values, mask) -> float:
    return float(values[mask].mean()) if bool(mask.any()) else float("nan")
