"""Target logprobs without the (B, T, V) logits: the model runs without its head, and the
head is applied a chunk of positions at a time.

`final_hidden(model)` makes a model call compute no logits: the output embedding's input,
the final hidden states (B, T, H), is kept, and the head itself sees an empty (B, 0, H).
`target_logprobs(head, hidden, targets)` then computes log_softmax(head(h))[target] for
chunks of about CHUNK_BYTES of fp32 logits each. With gradients every chunk of a call that
needs several runs under torch.utils.checkpoint: its forward keeps only its (B, c, H)
input, and backward recomputes its logits, so at most one chunk's logits (and their
gradient) exist at any time; a call of one chunk keeps its logits (no recomputation). Chunks
cut positions, never rows: the head is called on all B rows, so a LoRA on the unembedding
(train_unembed) is routed per row by the AdapterBank exactly as in a whole-model call.

Final-logit transforms that some architectures apply after the head (Gemma's softcapping,
Cohere's logit_scale, Granite's logits_scaling) are applied per chunk (`logit_transform`);
`check_head` compares the chunked path with the model's own logits once at load, so an
architecture with a transform this module does not know is refused instead of scored wrong.

On CUDA, rows whose head has no LoRA and plain (T,) targets take Cut Cross-Entropy's fused
kernel (`cut_cross_entropy.linear_cross_entropy`, exact preset) when that package is
installed (the `gpu` extra); everything else takes the chunked torch path.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

CHUNK_BYTES = 64 << 20  # fp32 logits of one chunk: (B, c, V) * 4 bytes at most (c >= 1)

Transform = Callable[[torch.Tensor], torch.Tensor]
ContextFn = Callable[
    [], tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]
]


@contextlib.contextmanager
def final_hidden(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Model calls in this context compute no logits; the list receives each call's final
    hidden states (B, T, H), the head's input (after the final norm)."""
    head = model.get_output_embeddings()
    captured: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple) -> tuple:
        captured.append(args[0])  # (B, T, H)
        return (args[0][:, :0], *args[1:])  # (B, 0, H): the head computes nothing

    handle = head.register_forward_pre_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


def logit_transform(config: object) -> Transform | None:
    """What the architecture's forward does to the head's output (None: nothing)."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        return lambda x: torch.tanh(x / cap) * cap
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, int | float) and scale != 1:
        return lambda x: x * scale
    divisor = getattr(config, "logits_scaling", None)
    if isinstance(divisor, int | float) and divisor != 1:
        return lambda x: x / divisor
    return None


def chunk_positions(rows: int, vocab: int, chunk_bytes: int) -> int:
    """Positions per chunk: (rows, c, vocab) fp32 logits within chunk_bytes (c >= 1)."""
    return max(1, chunk_bytes // max(1, rows * vocab * 4))


def target_logprobs(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    transform: Transform | None = None,
    context_fn: ContextFn | None = None,
    plain_head: bool = False,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """log_softmax(transform(head(hidden)))[targets] in fp32: (B, T) for (B, T) targets,
    (B, T, K) for (B, T, K) ones. `context_fn` is torch.utils.checkpoint's: what a chunk's
    recomputation in backward must run in (the rows' adapter routing). plain_head: no row
    of this call has a LoRA on the head, so a fused kernel may read its weight alone."""
    B, T = hidden.shape[:2]
    fused = _fused(head, hidden, targets, transform) if plain_head else None
    if fused is not None:
        return fused
    c = chunk_positions(B, head.weight.shape[0], chunk_bytes or CHUNK_BYTES)
    one = partial(_chunk_logprobs, head, transform)
    # one chunk: its logits (at most chunk_bytes) are kept for backward, not recomputed
    grad = torch.is_grad_enabled() and T > c
    pieces = []
    for t0 in range(0, T, c):
        h, tg = hidden[:, t0 : t0 + c], targets[:, t0 : t0 + c]  # (B, c, H), (B, c[, K])
        if grad:
            kw = {"context_fn": context_fn} if context_fn is not None else {}
            pieces.append(checkpoint(one, h, tg, use_reentrant=False, **kw))
        else:
            pieces.append(one(h, tg))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)  # (B, T[, K])


def _chunk_logprobs(
    head: nn.Module, transform: Transform | None, h: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logits = head(h)  # (B, c, V)
    if transform is not None:
        logits = transform(logits)
    B, c, V = logits.shape
    flat = targets.reshape(B * c, -1)  # (M, K); K = 1 for (B, c) targets
    lp = TargetLogprobs.apply(logits.float().reshape(B * c, V), flat)  # (M, K)
    return lp.view(targets.shape)


class TargetLogprobs(torch.autograd.Function):
    """log_softmax(logits)[targets] per row of (M, V) logits and (M, K) targets,
    differentiable in the logits.

    What log_softmax + gather give, in fewer passes over the vocabulary: it keeps the logits
    and their logsumexp (M,) instead of an (M, V) log_softmax, and its backward writes
    -sum_k(g) * softmax in one pass and adds g at the targets (scatter_add: a target named
    twice in a row gets both), where log_softmax's backward zero-fills an (M, V) gradient,
    scatters into it and then runs over both.
    """

    @staticmethod
    def forward(ctx, logits, targets):
        lse = torch.logsumexp(logits, -1)  # (M,)
        ctx.save_for_backward(logits, lse, targets)
        return logits.gather(-1, targets) - lse[:, None]  # (M, K)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        logits, lse, targets = ctx.saved_tensors
        d = torch.sub(logits, lse[:, None]).exp_().mul_(-g.sum(-1, keepdim=True))  # (M, V)
        return d.scatter_add_(-1, targets, g), None


def check_head(model: nn.Module, probe_len: int = 4) -> None:
    """Raise ValueError if the chunked path does not give the model's own logprobs on a
    short probe (an architecture whose final-logit transform logit_transform misses)."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding with a weight")
    device = head.weight.device
    vocab = head.weight.shape[0]
    ids = torch.arange(probe_len, device=device)[None] % vocab  # (1, P)
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)  # (1, P, V)
        with final_hidden(model) as kept:
            model(input_ids=ids, use_cache=False)
        tgt = ids.roll(-1, 1)  # (1, P)
        ours = target_logprobs(head, kept[0], tgt, logit_transform(model.config))  # (1, P)
    theirs = whole.gather(-1, tgt[..., None])[..., 0]
    if not torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3):
        raise ValueError(
            f"{type(model).__name__}: logprobs from the final hidden states differ from the "
            f"model's own (max difference {float((ours - theirs).abs().max()):.3g}): its "
            "forward transforms the logits in a way treadle.engine.logprobs does not know"
        )


# ---- the fused kernel (CUDA) ----------------------------------------------------------------


def _cce() -> Callable | None:
    """cut_cross_entropy.linear_cross_entropy where the package imports (with triton)."""
    if not hasattr(_cce, "fn"):
        fn = None
        if importlib.util.find_spec("cut_cross_entropy") is not None:
            try:
                from cut_cross_entropy import linear_cross_entropy as fn
            except Exception:  # noqa: BLE001 - a broken install falls back to torch
                fn = None
        _cce.fn = fn
    return _cce.fn


def _fused(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, transform: Transform | None
) -> torch.Tensor | None:
    """Cut Cross-Entropy's target logprobs where it applies (CUDA, a head no row of the call
    has a LoRA on, no transform, (B, T) targets), else None."""
    if hidden.device.type != "cuda" or targets.dim() != 2 or transform is not None:
        return None
    if not isinstance(head, nn.Linear):
        return None
    fn = _cce()
    if fn is None:
        return None
    B, T, H = hidden.shape
    nll = fn(
        hidden.reshape(B * T, H),
        head.weight.to(hidden.dtype),
        targets.reshape(B * T),
        bias=head.bias,
        reduction="none",
        impl="cce_exact",  # no gradient filtering: the same numbers as the torch path
    )  # (B*T,)
    return -nll.float().view(B, T)
