"""A worker group of 2 gloo ranks on CPU gives the numbers of one process (1e-5, fp32).

The same calls (tests/_scenario.py) run on one Engine here and on a group
spawned with torch.multiprocessing: a forward_backward whose batch mixes 3 sessions (one of
them in two batches, all cut between the ranks), a call of one row (one rank has nothing),
a forward, an infinite loss beside a good batch of its adapter, 5 optim_steps, seeded
samples from adapters, a snapshot and the base, and the continuous decode batch the worker
keeps (the same tokens, logprobs and streamed tokens; every rank yields after the same
step; requests join mid-generation). With and without FSDP2.

    .venv/bin/python -m pytest -q tests/worker/test_group_engine.py
"""

from __future__ import annotations

import socket
from pathlib import Path

import _scenario as scenario  # noqa: E402
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from treadle.engine import Engine

    torch.set_num_threads(1)
    engine = Engine(tiny_model_dir)
    files = tmp_path_factory.mktemp("one-process")
    return scenario.run(engine, engine.bank, files) | {"files": files}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _close(a, b) -> None:
    torch.testing.assert_close(
        torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b)), **TOL
    )


@pytest.mark.parametrize("shard", ["none", "fsdp"])
def test_two_ranks_equal_one_process(reference, tiny_model_dir, tmp_path, shard):
    args = (2, _free_port(), str(tiny_model_dir), shard, str(tmp_path))
    mp.spawn(scenario.rank_main, args=args, nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    other = torch.load(tmp_path / "rank1.pt", weights_only=False)

    for ref_call, call in zip(reference["fb"], got["fb"], strict=True):
        for (ref_lps, ref_loss), (lps, loss) in zip(ref_call, call, strict=True):
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            for a, b in zip(ref_lps, lps, strict=True):
                _close(a, b)
    for a, b in zip(reference["one"], got["one"], strict=True):
        _close(a, b)
    for ref_call, call in zip(reference["forward"], got["forward"], strict=True):
        for a, b in zip(ref_call, call, strict=True):
            _close(a, b)
    for ref_metrics, metrics in zip(reference["nonfinite"], got["nonfinite"], strict=True):
        assert [m["nonfinite:sum"] for m in metrics] == [m["nonfinite:sum"] for m in ref_metrics]
        assert [m["nonfinite:sum"] for m in metrics] in ([0.0, 1.0, 0.0], [1.0])
    for s in scenario.SESSIONS:
        for a, b in zip(reference["grads"][s], got["grads"][s], strict=True):
            _close(a, b)
        for a, b in zip(reference["adapters"][s], got["adapters"][s], strict=True):
            _close(a, b)
        # optim_step leaves every rank with the same adapter, bit for bit
        for a, b in zip(got["adapters"][s], other["adapters"][s], strict=True):
            assert torch.equal(a, b)
    # seeded samples: the same tokens as one process, wherever each request ran
    for (ref_tokens, ref_lps, ref_prompt), (tokens, lps, prompt) in zip(
        reference["samples"], got["samples"], strict=True
    ):
        assert tokens == ref_tokens
        for a, b in zip(ref_lps, lps, strict=True):
            _close(a, b)
        assert (prompt is None) == (ref_prompt is None)
        if prompt is not None:
            _close(prompt[1:], ref_prompt[1:])
    assert got["snap"] == reference["snap"]

    for a, b in zip(reference["copy"], got["copy"], strict=True):
        _close(a, b)
    for a, b in zip(got["adapters"]["s1"], other["adapters"]["copy"], strict=True):
        assert torch.equal(a, b)  # rank 1 loaded the bytes rank 0 saved
    from safetensors.torch import load_file

    merged = load_file(tmp_path / "merged-s0" / "model.safetensors")
    ref_merged = load_file(reference["files"] / "merged-s0" / "model.safetensors")
    assert merged.keys() == ref_merged.keys()
    for key in merged:  # under FSDP too: the whole weights, merged
        _close(merged[key], ref_merged[key])

    _same_decoding(reference["decode"], got["decode"])
    # the yield: every rank ran exactly the steps rank 0's until() allowed
    assert got["decode_steps"] == other["decode_steps"] == ["d"] * scenario.YIELD_AFTER

    after = got["after_failures"]
    assert "outside the vocabulary" in after["refused"]
    assert after["failed"] == "rank 1 ran out of memory"
    assert after["add_failed"] == "rank 1 could not prefill"
    assert after["after_failed_add"] == (0, [])  # rank 0's share of that add was not kept
    assert after["step_failed"] == "rank 1 could not decode"
    assert after["served"]
    assert after["still_serving"]

    full = sum(p.numel() for p in scenario_base(tiny_model_dir).parameters())
    if shard == "fsdp":  # each rank holds about half of the base
        assert got["base_numel"] < 0.6 * full
    else:
        assert got["base_numel"] == full


def _same_decoding(ref: dict, got: dict) -> None:
    """The group's decode batch against one process's: the same yield, the same adapters
    routed, the same tokens (logprobs to 1e-5), and streamed tokens that are the results."""
    assert got["yielded"] == ref["yielded"]
    steps, handed_back, open_requests, rows = got["yielded"]
    assert steps == scenario.YIELD_AFTER and open_requests > 0 and rows > 0
    assert got["keys"] == ref["keys"] == {"s0", "s1", "s2", "snap:s1"}
    assert got["keys_after"] == ref["keys_after"] == set()
    for (ref_tokens, ref_lps), (tokens, lps) in zip(ref["results"], got["results"], strict=True):
        assert tokens == ref_tokens
        for a, b in zip(ref_lps, lps, strict=True):
            _close(a, b)
    _close(got["prompt_lps"][1:], ref["prompt_lps"][1:])
    assert got["streamed"].keys() == ref["streamed"].keys()
    for (i, j), heard in got["streamed"].items():
        tokens, lps = got["results"][i][0][j], got["results"][i][1][j]
        assert [pos for pos, _, _ in heard] == list(range(len(tokens)))
        assert [tok for _, tok, _ in heard] == tokens
        assert [lp for _, _, lp in heard] == pytest.approx(lps, abs=1e-6)
    # a request dropped (cancelled) between two steps: counted, gone, the other unchanged
    assert got["dropped"] == ref["dropped"]
    assert ref["dropped"][0] == {0: 4} and ref["dropped"][2] == 1  # 2 samples x 2 steps


def scenario_base(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)
