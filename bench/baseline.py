"""The yardstick of every bench that compares Treadle with code a user would write by hand:
plain transformers + torch + peft, one process, written the way their docs teach.

    from baseline import lora_model, ce_forward_backward, ppo_forward_backward, sample

- `lora_model`: `peft.get_peft_model` with a `LoraConfig` on TARGETS, the layers the service
  trains by default (LoraSpec: attention, MLP *and the unembedding*, lm_head), dropout 0.
- `ce_forward_backward`: the logits, then one fused `F.cross_entropy` (reduction "sum", or
  "none" times the weights when they are not all one), then `backward()`.
- `token_logprobs` / `ppo_forward_backward`: the same fused cross entropy per token
  (reduction "none"), the PPO clipped objective on top.
- `sample`: `model.generate` (KV cache, plain sampling) under inference_mode, and the sampled
  tokens' logprobs from its scores by `compute_transition_scores` (the way the transformers
  docs give them), so PPO needs no extra pass for its old logprobs.
- `adamw`: `torch.optim.AdamW` with the service's defaults (betas 0.9/0.95, eps 1e-12, no
  weight decay).

Nothing here does work the service skips; the service does more (per-token logprobs for every
datum, sent back; checks of its inputs and gradients). Each bench checks its use of these
against an independent plain loop (`plain_ce_forward_backward`: transformers' own `labels=`
loss; `plain_token_logprobs`: log_softmax and gather) in the same run.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F

# The modules the service gives a LoRA by default (LoraSpec: train_attn, train_mlp and
# train_unembed all true) on Llama / Qwen shapes.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def lora_model(
    base: torch.nn.Module | str | Path,
    rank: int,
    alpha: float,
    dtype=torch.float32,
    targets: list[str] | None = None,
    target_parameters: list[str] | None = None,
):
    """A peft LoRA model on `base` (a model, or a folder to load with from_pretrained), on
    TARGETS unless `targets` names other modules; a MoE model's fused expert weights through
    peft's `target_parameters`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if not isinstance(base, torch.nn.Module):
        base = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets or TARGETS,
        target_parameters=target_parameters, lora_dropout=0.0,
    )  # fmt: skip
    return get_peft_model(base, config)


def adamw(model, lr: float) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)


def ce_forward_backward(
    model, ids: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum of the weighted token cross entropies of ids (B, T) predicting targets (B, T),
    backpropagated; → the loss."""
    logits = model(input_ids=ids, use_cache=False).logits  # (B, T, V)
    V = logits.shape[-1]
    if weights is None:
        loss = F.cross_entropy(logits.float().view(-1, V), targets.reshape(-1), reduction="sum")
    else:
        per = F.cross_entropy(logits.float().view(-1, V), targets.reshape(-1), reduction="none")
        loss = (per * weights.reshape(-1)).sum()
    loss.backward()
    return loss.detach()


def token_logprobs(model, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets | ids) per position: (N, L), differentiable."""
    logits = model(input_ids=ids, use_cache=False).logits  # (N, L, V)
    N, L, V = logits.shape
    per = F.cross_entropy(logits.float().view(N * L, V), targets.reshape(N * L), reduction="none")
    return -per.view(N, L)


def ppo_forward_backward(
    model,
    ids: torch.Tensor,
    targets: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip: tuple[float, float] = (0.8, 1.2),
    logprobs_fn=token_logprobs,
) -> torch.Tensor:
    """The PPO clipped objective, summed over tokens (advantage 0 masks a token out):
    ids, targets, old_logprobs, advantages all (N, L); → the loss, backpropagated."""
    lp = logprobs_fn(model, ids, targets)  # (N, L)
    ratio = torch.exp(lp - old_logprobs)
    clipped = torch.clamp(ratio, *clip)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    loss.backward()
    return loss.detach()


def sample(model, prompts: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts (N, P) → (sequences (N, P + new), logprobs of the new tokens (N, new)), at
    temperature 1 with no top-k / top-p and exactly `new_tokens` each (EOS ignored)."""
    cfg = copy.deepcopy(model.generation_config)
    cfg.update(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0,
        max_new_tokens=new_tokens, min_new_tokens=None, output_scores=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    with torch.inference_mode():
        out = model.generate(
            input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=cfg
        )
        lp = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    assert out.sequences.shape[1] == prompts.shape[1] + new_tokens, out.sequences.shape
    return out.sequences.clone(), lp.clone()  # (N, P + new), (N, new): normal tensors again


# ---- independent plain loops: do the baselines above leave speed on the table? ----


def plain_ce_forward_backward(model, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' own loss: tokens (B, T + 1) as input_ids and labels (the model shifts
    them), the mean token loss scaled back to a sum; → the loss, backpropagated."""
    out = model(input_ids=tokens, labels=tokens, use_cache=False)
    loss = out.loss * (tokens.shape[0] * (tokens.shape[1] - 1))
    loss.backward()
    return loss.detach()


def plain_token_logprobs(model, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary, then gather: (N, L), differentiable."""
    logits = model(input_ids=ids, use_cache=False).logits  # (N, L, V)
    return logits.float().log_softmax(-1).gather(-1, targets[..., None])[..., 0]
