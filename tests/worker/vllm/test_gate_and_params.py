"""The parity gate's arithmetic and schedule, and a request's mapping onto vLLM's
parameters: no vLLM process needed."""

from __future__ import annotations

import math

import pytest

from treadle.engine.types import SampleRequest, SampleSpec
from treadle.worker.vllm.batch import _params
from treadle.worker.vllm.gate import ParityGate, measure, thresholds_for


def test_measure_against_its_formulas():
    fp32 = thresholds_for("float32")
    a, b = [-1.0, -2.0, -0.5], [-1.0, -2.1, -0.45]
    v = measure("k", a, b, [1, 2, 3], fp32)
    assert v.mean_abs == pytest.approx((0 + 0.1 + 0.05) / 3)
    assert v.max_abs == pytest.approx(0.1)
    # k3: r = p_trainer / p_sampler, mean(r - 1 - log r)
    k3 = sum(math.exp(y - x) - 1 - (y - x) for x, y in zip(a, b, strict=True)) / 3
    assert v.kl == pytest.approx(k3) and v.kl > 0
    assert not v.passed and v.worst[0] == (2, -2.0, -2.1)
    same = measure("k", a, [x + 1e-7 for x in a], [1, 2, 3], fp32)
    assert same.passed and same.kl >= 0


def test_thresholds_per_dtype_and_override():
    assert thresholds_for("float32").max_abs < thresholds_for("bfloat16").max_abs
    t = thresholds_for("torch.float32", max_abs=2e-3)
    assert t.max_abs == 2e-3 and t.mean_abs == pytest.approx(2e-4)


def test_gate_checks_first_result_then_every_n():
    gate = ParityGate(thresholds_for("float32"), every_n=4, every_s=1e9)
    assert gate.due("s")  # a refresh: the first result is checked
    gate.last["s"] = measure("s", [-1.0], [-1.0], [5], gate.thresholds)
    due = [gate.due("s") for _ in range(8)]
    assert due == [False, False, False, True, False, False, False, True]
    assert not ParityGate(gate.thresholds, enabled=False).due("t")


class _Engine:
    eos_token_ids = [0, 2]


def test_params_map_seeds_stops_and_logprobs():
    spec = SampleSpec(max_tokens=9, temperature=0.7, top_k=-1, top_p=0.9, seed=5,
                      stop_strings=["\n\n"], stop_tokens=[7, 2])  # fmt: skip
    req = SampleRequest([1, 2, 3], num_samples=3, params=spec, topk_sample_logprobs=4)
    p = [_params(_Engine(), req, j) for j in range(3)]
    assert [q["seed"] for q in p] == [5, 6, 7]  # vLLM's own fan-out: seed + j
    assert p[0]["stop_token_ids"] == [7, 2, 0]  # the request's, then EOS ids (once each)
    assert p[0]["top_k"] == 0 and p[0]["logprobs"] == 4 and p[0]["stop"] == ["\n\n"]
    no_eos = SampleRequest([1], params=SampleSpec(stop_at_eos=False, seed=None))
    q = _params(_Engine(), no_eos, 0)
    assert q["stop_token_ids"] == [] and q["seed"] is None


def test_config_refuses_what_the_vllm_sampler_cannot_do():
    from pydantic import ValidationError

    from treadle.server.config import ServerConfig

    with pytest.raises(ValidationError, match="sampler must be torch or vllm"):
        ServerConfig(models={"m": "x"}, sampler="sglang")
    with pytest.raises(ValidationError, match="devices 2"):
        ServerConfig(models={"m": "x"}, sampler="vllm", devices=2)
    assert ServerConfig(models={"m": "x"}, sampler="vllm").parity_gate  # on by default
