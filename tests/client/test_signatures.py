"""Compat pin: the treadle SDK's methods take the tinker SDK's (0.38) parameters, by the same
names and in the same positions, except those listed here as not supported.

Code written for tinker (positional or keyword) therefore runs unchanged on treadle as long as
it avoids the unsupported parameters.

    .venv/bin/python -m pytest -q tests/client/test_signatures.py
"""

from __future__ import annotations

import inspect

import pytest

from treadle import SamplingClient, ServiceClient, TrainingClient

tinker_api = pytest.importorskip("tinker.lib.public_interfaces")

# tinker parameters treadle does not take (the server has no matching feature)
UNSUPPORTED = {
    "optimizer",  # only AdamW is served
    "weights_access_token",  # no cross-account checkpoints
    "retry_config",  # one RetryPolicy per ServiceClient instead
    "kind",  # snapshots only; no "inflight" sampling clients
    "loss_type_input",  # deprecated in tinker itself
}

METHODS = {
    (ServiceClient, "ServiceClient"): [
        "create_lora_training_client",
        "create_training_client_from_state",
        "create_training_client_from_state_with_optimizer",
        "create_sampling_client",
    ],
    (TrainingClient, "TrainingClient"): [
        "forward",
        "forward_backward",
        "forward_backward_custom",
        "optim_step",
        "save_state",
        "load_state",
        "load_state_with_optimizer",
        "save_weights_for_sampler",
        "save_weights_and_get_sampling_client",
        "create_sampling_client",
        "get_info",
        "get_tokenizer",
    ],
    (SamplingClient, "SamplingClient"): [
        "sample",
        "compute_logprobs",
        "get_tokenizer",
        "get_base_model",
    ],
}

CASES = [(ours, theirs, name) for (ours, theirs), names in METHODS.items() for name in names]


def _params(fn) -> list[inspect.Parameter]:
    fn = inspect.unwrap(fn)
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("ours, theirs, name", CASES, ids=[f"{c[1]}.{c[2]}" for c in CASES])
def test_treadle_takes_tinker_parameters(ours, theirs, name):
    tinker_params = [
        p for p in _params(getattr(getattr(tinker_api, theirs), name)) if p.name not in UNSUPPORTED
    ]
    our_params = _params(getattr(ours, name))
    ours_by_name = {p.name: p for p in our_params}
    for p in tinker_params:
        assert p.name in ours_by_name, f"{theirs}.{name}: missing parameter {p.name!r}"
        assert ours_by_name[p.name].kind == p.kind, f"{theirs}.{name}({p.name}): kind differs"
    # positional parameters keep tinker's order, so positional calls mean the same thing
    positional = [p.name for p in tinker_params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in our_params][: len(positional)] == positional
