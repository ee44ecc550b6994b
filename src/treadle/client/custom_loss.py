"""The local half of TrainingClient.forward_backward_custom: a loss written in torch.

The server computes logprobs with a forward (datums whose weights are zero: _zero_weights,
_ce_datum); _custom_weights runs the user's loss on them here and turns its gradient into
cross-entropy weights, so that the server's backward with them gives the custom loss's
gradient. torch is imported only when a custom loss runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from treadle.types import Datum, ForwardBackwardOutput

# fn(data, logprobs_list) -> (loss, metrics); logprobs_list[i] is a torch tensor shaped like
# data[i]'s target_tokens.
CustomLossFn = Callable[[list[Datum], list[Any]], tuple[Any, dict[str, float]]]


def _zero_weights(datum: Datum) -> np.ndarray:
    if "target_tokens" not in datum.loss_fn_inputs:
        raise ValueError("loss_fn_inputs: forward_backward_custom needs 'target_tokens'")
    return np.zeros(datum.loss_fn_inputs["target_tokens"].to_numpy().shape, dtype=np.float32)


def _ce_datum(datum: Datum, weights: np.ndarray) -> Datum:
    return Datum(
        model_input=datum.model_input,
        loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"], "weights": weights},
    )


def _custom_weights(
    data: list[Datum], loss_fn: CustomLossFn, fwd_out: ForwardBackwardOutput
) -> tuple[list[Datum], float, dict[str, float]]:
    """Run the user's loss on the forward's logprobs; weights = -dL/dlogprobs per datum.

    The server's cross-entropy is sum(-w * logprobs), so its gradient with these weights is
    exactly dL/dparams by the chain rule.
    """
    try:
        import torch
    except ImportError as exc:
        raise ImportError("forward_backward_custom needs torch (pip install torch)") from exc
    logprobs_D = [
        torch.tensor(out["logprobs"].to_numpy(), dtype=torch.float32).requires_grad_(True)
        for out in fwd_out.loss_fn_outputs
    ]
    loss, metrics = loss_fn(data, logprobs_D)
    loss.backward()
    weighted = []
    for datum, lp in zip(data, logprobs_D, strict=True):
        grad = lp.grad if lp.grad is not None else torch.zeros_like(lp)
        weighted.append(_ce_datum(datum, (-grad).numpy()))
    return weighted, float(loss.detach().sum()), {k: float(v) for k, v in metrics.items()}
