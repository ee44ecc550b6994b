"""The reusable supervised loop: chats rendered with the model's chat template, loss only on
what the assistant says, one example per datum, held-out NLL.

Examples are never concatenated into one sequence: in one row they would attend to each
other (an example's logprobs would depend on whatever preceded it). Each is its own datum,
and the server batches the rows of a step side by side, each attending only to itself.

Weights are scaled by 1/(trained tokens in the batch), so the server's summed cross-entropy
is a per-token mean and the learning rate does not depend on the batch size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from treadle import AdamParams, Datum, ModelInput
from treadle.cookbook.estimate import announce, sft_run_plan
from treadle.cookbook.run_dir import RunDir, open_training_client, step_bar, step_rng

Example = tuple[list[int], list[float]]  # (tokens_T, weights_T): weight 1 where trained


@dataclass
class SFTConfig:
    model: str
    run_dir: str
    base_url: str | None = None
    lora_rank: int = 32
    lora_alpha: float | None = None
    learning_rate: float = 1e-4
    lr_schedule: str = "cosine"  # constant | linear | cosine (to 10 %), after warmup
    warmup_frac: float = 0.05
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    grad_clip_norm: float = 1.0
    batch_size: int = 32  # examples (datums) per step
    max_length: int = 512
    max_steps: int = 100
    eval_every: int = 20
    save_every: int = 50
    seed: int = 0
    mlflow_uri: str | None = None
    wandb_project: str | None = None  # log to Weights & Biases too (tinker-cookbook's names)
    wandb_name: str | None = None


# ---- rendering ----------------------------------------------------------------------------


def chat_tokens(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template."""
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, return_dict=True
    )
    return list(out["input_ids"])


def render_chat(tokenizer, messages: list[dict], max_length: int) -> Example:
    """Tokens of a conversation and a weight of 1 on assistant tokens (and their end token)."""
    out = tokenizer.apply_chat_template(
        messages, return_assistant_tokens_mask=True, return_dict=True
    )
    tokens_T, mask_T = list(out["input_ids"]), list(out["assistant_masks"])
    if not any(mask_T):
        raise ValueError(
            "the chat template marks no assistant tokens ({% generation %} markers are needed), "
            "or the conversation has no assistant message"
        )
    return tokens_T[:max_length], [float(m) for m in mask_T[:max_length]]


def render_completion(tokenizer, prompt: str, completion: str, max_length: int) -> Example:
    """A raw prompt/completion pair: loss on the completion and the end-of-sequence token."""
    prompt_T = tokenizer.encode(prompt, add_special_tokens=False)
    completion_T = tokenizer.encode(completion, add_special_tokens=False)
    completion_T.append(tokenizer.eos_token_id)
    tokens_T = (prompt_T + completion_T)[:max_length]
    weights_T = ([0.0] * len(prompt_T) + [1.0] * len(completion_T))[:max_length]
    return tokens_T, weights_T


def training_sequences(examples: Sequence[Example], max_length: int) -> list[Example]:
    """One sequence per example, cut to max_length: never two examples in one row."""
    return [(list(t)[:max_length], list(w)[:max_length]) for t, w in examples]


def example_to_datum(example: Example, scale: float = 1.0) -> Datum:
    """Shift by one: input token i predicts token i+1, weighted by that token's weight."""
    tokens_T, weights_T = example
    return Datum(
        model_input=ModelInput.from_ints(tokens_T[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens_T[1:], dtype=np.int64),
            "weights": np.asarray(weights_T[1:], dtype=np.float32) * scale,
        },
    )


def make_batch(examples: Sequence[Example]) -> list[Datum]:
    n_weighted = sum(sum(w[1:]) for _, w in examples)
    return [example_to_datum(e, 1.0 / max(n_weighted, 1.0)) for e in examples]


# ---- loop ---------------------------------------------------------------------------------


def learning_rate_at(config: SFTConfig, step: int) -> float:
    warmup = max(1, int(config.warmup_frac * config.max_steps))
    if step < warmup:
        return config.learning_rate * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.max_steps - warmup)
    if config.lr_schedule == "constant":
        factor = 1.0
    elif config.lr_schedule == "linear":
        factor = 1.0 - 0.9 * progress
    else:
        factor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return config.learning_rate * factor


def eval_nll(training_client, examples: Sequence[Example], batch_size: int = 64) -> float:
    """Mean NLL per trained token on held-out examples (a forward pass, no gradients)."""
    total_nll, total_w = 0.0, 0.0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        datums = [example_to_datum(e) for e in chunk]
        out = training_client.forward(datums, loss_fn="cross_entropy").result()
        for datum, o in zip(datums, out.loss_fn_outputs, strict=True):
            w = datum.loss_fn_inputs["weights"].to_numpy()
            total_nll -= float((o["logprobs"].to_numpy() * w).sum())
            total_w += float(w.sum())
    return total_nll / max(total_w, 1.0)


def train_sft(
    config: SFTConfig,
    train: Sequence[Example],
    test: Sequence[Example] = (),
    service=None,
) -> tuple[RunDir, object]:
    """Run (or resume) SFT; returns the run folder and the training client (to go on with RL)."""
    from treadle import ServiceClient

    run = RunDir(
        config.run_dir,
        config,
        mlflow_uri=config.mlflow_uri,
        wandb_project=config.wandb_project,
        wandb_name=config.wandb_name,
    )
    sequences = training_sequences(train, config.max_length)
    svc = service or ServiceClient(base_url=config.base_url)
    training_client, start, _ = open_training_client(
        svc, run, config.model, config.lora_rank, config.lora_alpha, config.seed
    )
    announce(svc, sft_run_plan(config, sequences, test))  # the run's cost, before it runs
    bar = step_bar("sft", start, config.max_steps)
    for step in bar:
        rng = step_rng(config.seed, step)
        batch = make_batch(rng.sample(sequences, min(config.batch_size, len(sequences))))
        lr = learning_rate_at(config, step)
        t0 = time.monotonic()
        fwd_bwd = training_client.forward_backward(batch, loss_fn="cross_entropy")
        optim = training_client.optim_step(
            AdamParams(
                learning_rate=lr,
                beta1=config.adam_beta1,
                beta2=config.adam_beta2,
                eps=1e-8,
                grad_clip_norm=config.grad_clip_norm,
            )
        )
        loss = fwd_bwd.result().metrics["loss:sum"]
        optim.result()
        metrics = {
            "train/nll": loss,
            "lr": lr,
            "time/step_s": time.monotonic() - t0,
            "train/tokens": float(sum(d.model_input.length for d in batch)),
        }
        if test and config.eval_every and (step + 1) % config.eval_every == 0:
            metrics["test/nll"] = eval_nll(training_client, test)
        run.log_metrics(step, metrics)
        if config.save_every and (step + 1) % config.save_every == 0:
            state = training_client.save_state(f"sft-{step + 1:06d}").result().path
            run.log_checkpoint(step + 1, state_path=state)
        bar.set_postfix(nll=f"{loss:.3f}")
    run.close()
    return run, training_client
