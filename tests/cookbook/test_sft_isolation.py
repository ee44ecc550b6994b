"""The cookbook's SFT never lets one example attend to another: example A's logprobs, as the
engine computes them for the datums the loop sends, do not change when the example B
beside it in the step changes."""

from __future__ import annotations

import numpy as np
import pytest

from treadle.cookbook.sft import make_batch, training_sequences
from treadle.engine.types import LoraSpec, TrainBatch, TrainDatum


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from treadle.engine import Engine

    eng = Engine(tiny_model_dir)
    eng.create_adapter("sft", LoraSpec(rank=4, seed=1))
    return eng


def _a_logprobs(engine, examples, a_tokens: list[int]) -> np.ndarray:
    """Logprobs of A's tokens in the datums the loop builds from `examples` (one step)."""
    datums = make_batch(training_sequences(examples, 512))
    data = [
        TrainDatum(
            np.asarray(d.model_input.to_ints()),
            {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()},
        )
        for d in datums
    ]
    (result,) = engine.forward_backward([TrainBatch("sft", data)], forward_only=True)
    n = len(a_tokens) - 1  # A's next-token predictions
    for datum, out in zip(data, result.outputs, strict=True):
        if datum.tokens[-n:].tolist() == a_tokens[:-1]:
            return out["logprobs"][-n:]
    raise AssertionError("no datum holds example A")


def test_an_example_does_not_see_its_neighbour(engine):
    rng = np.random.default_rng(0)
    a = rng.integers(3, engine.vocab_size, 12).tolist()
    b1 = rng.integers(3, engine.vocab_size, 9).tolist()
    b2 = rng.integers(3, engine.vocab_size, 17).tolist()  # another B, longer: more padding
    ones = lambda t: [1.0] * len(t)  # noqa: E731
    with_b1 = _a_logprobs(engine, [(b1, ones(b1)), (a, ones(a))], a)
    with_b2 = _a_logprobs(engine, [(b2, ones(b2)), (a, ones(a))], a)
    alone = _a_logprobs(engine, [(a, ones(a))], a)
    np.testing.assert_allclose(with_b1, alone, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(with_b2, alone, rtol=1e-5, atol=1e-6)
