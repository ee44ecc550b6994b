"""Server-side custom losses (treadle.engine.loss_graph): graphs traced and encoded by the
official tinker SDK, read back, checked and run over the allow-listed torch ops, against
the loss functions themselves in plain torch (values and autograd gradients).

    .venv/bin/python -m pytest -q tests/engine/test_loss_graph.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from treadle.engine.loss_graph import FUNCTIONS, CustomLoss, check_cost, run
from treadle.engine.loss_graph_spec import (
    ALLOWED_FUNCTIONS,
    MAX_NODES,
    parse_graph,
    validate_custom_batch,
)
from treadle.engine.types import TrainDatum
from treadle.errors import InvalidRequestError

custom_loss = pytest.importorskip("tinker.lib.public_interfaces.custom_loss")


def dpo(logprobs, chosen_mask, rejected_mask, ref_margin):
    margin = (logprobs * chosen_mask).sum() - (logprobs * rejected_mask).sum() - ref_margin
    loss = -F.logsigmoid(0.5 * margin)
    return loss, {"custom/margin:mean": margin.detach(), "custom/acc:mean": (margin > 0).float()}


def dpo_nll(logprobs, chosen_mask, rejected_mask, ref_margin):
    margin = (logprobs * chosen_mask).sum() - (logprobs * rejected_mask).sum() - ref_margin
    nll = -(logprobs * chosen_mask).sum() / chosen_mask.sum().clamp(min=1.0)
    loss = -F.logsigmoid(0.5 * margin) + 0.1 * nll
    return loss, {"custom/nll:sum": nll}


def kto(logprobs, weights, ref_logprob, desirable):
    reward = (logprobs * weights).sum() - ref_logprob
    value = torch.where(desirable > 0, torch.sigmoid(0.3 * reward), torch.sigmoid(-0.3 * reward))
    return 1.0 - value, {"custom/reward:mean": reward}


RANKS = {
    dpo: {"logprobs": 1, "chosen_mask": 1, "rejected_mask": 1, "ref_margin": 0},
    dpo_nll: {"logprobs": 1, "chosen_mask": 1, "rejected_mask": 1, "ref_margin": 0},
    kto: {"logprobs": 1, "weights": 1, "ref_logprob": 0, "desirable": 0},
}


def upload(fn, ranks=None) -> dict:
    """What ServiceClient.create_custom_loss sends, made by the SDK itself."""
    handle = custom_loss.trace_loss(fn, ranks or RANKS[fn], "session")
    return {
        "name": handle.name,
        "inputs": [i.model_dump() for i in handle.inputs],
        "graph": json.loads(custom_loss.encode_graph(handle).model_dump_json()),
    }


def graph_of(fn, ranks=None):
    u = upload(fn, ranks)
    return parse_graph(u["name"], u["inputs"], u["graph"])


def datum(rng, fn, T: int) -> TrainDatum:
    half = T // 2
    chosen = np.r_[np.ones(half), np.zeros(T - half)].astype(np.float32)
    inputs = {"target_tokens": rng.integers(0, 50, T)}
    if fn is kto:
        inputs |= {
            "weights": rng.uniform(0, 1, T).astype(np.float32),
            "ref_logprob": np.array([rng.normal()], np.float32),  # a scalar: no shape
            "desirable": np.array([float(rng.integers(0, 2))], np.float32),
        }
    else:
        inputs |= {
            "chosen_mask": chosen,
            "rejected_mask": 1 - chosen,
            "ref_margin": np.array([rng.normal()], np.float32),
        }
    return TrainDatum(rng.integers(0, 50, T), inputs)


@pytest.mark.parametrize("fn", [dpo, dpo_nll, kto])
def test_per_token_sum_and_gradients_equal_the_loss_itself(fn):
    rng = np.random.default_rng(0)
    lengths = [5, 9, 7]
    data = [datum(rng, fn, T) for T in lengths]
    lp = torch.randn(len(lengths), max(lengths), dtype=torch.float32, requires_grad=True)
    custom = CustomLoss(graph_of(fn))
    sent = [d.loss_inputs["target_tokens"] for d in data]
    per_token = custom.per_token(lp, data, sent)  # (n, T)
    ours = per_token.sum()
    (g_ours,) = torch.autograd.grad(ours, lp)

    want, metric_sums = 0.0, {}
    for i, d in enumerate(data):
        args = [torch.as_tensor(d.loss_inputs[k]) for k in list(RANKS[fn])[1:]]
        args = [a.reshape(()) if a.numel() == 1 else a for a in args]
        loss, metrics = fn(lp[i, : lengths[i]], *args)
        want = want + loss
        for k, v in metrics.items():
            metric_sums[k] = metric_sums.get(k, 0.0) + float(v)
    (g_want,) = torch.autograd.grad(want, lp)
    assert float(ours.detach()) == pytest.approx(float(want.detach()), abs=1e-6)
    torch.testing.assert_close(g_ours, g_want, atol=1e-7, rtol=0)
    assert per_token[:, 1:].abs().sum() == 0  # each datum's loss in its first cell only

    logprobs = [lp[i, :T].detach().numpy() for i, T in enumerate(lengths)]
    got = custom.metrics(data, logprobs)
    for k, v in metric_sums.items():
        assert got[k] == pytest.approx(v / len(data) if k.endswith(":mean") else v, abs=1e-5)


def test_top_k_logprobs_rank_two():
    def spread(logprobs, target_weights):
        return -(logprobs * target_weights).sum(), {}

    graph = graph_of(spread, {"logprobs": 2, "target_weights": 2})
    rng = np.random.default_rng(1)
    data = [
        TrainDatum(rng.integers(0, 50, T), {"target_tokens": rng.integers(0, 50, (T, K)),
                                            "target_weights": rng.uniform(0, 1, (T, K))})
        for T, K in ((4, 3), (6, 2))
    ]  # fmt: skip
    validate_custom_batch(graph, data, 50, 64)
    lp = torch.randn(2, 6, 3, requires_grad=True)
    ours = CustomLoss(graph).per_token(lp, data, [d.loss_inputs["target_tokens"] for d in data])
    want = sum(
        -(lp[i, : d.tokens.size, : d.loss_inputs["target_weights"].shape[1]]
          * torch.as_tensor(d.loss_inputs["target_weights"], dtype=torch.float32)).sum()
        for i, d in enumerate(data)
    )  # fmt: skip
    assert float(ours.sum()) == pytest.approx(float(want), abs=1e-5)


def test_every_allowed_function_exists_in_this_torch():
    missing = sorted(n for n in ALLOWED_FUNCTIONS if n not in FUNCTIONS)
    assert not missing, missing


def test_a_forbidden_op_is_refused_naming_it():
    def leaks(logprobs):
        return torch.matmul(logprobs[:, None], logprobs[None, :]).sum(), {}

    with pytest.raises(InvalidRequestError, match="torch.matmul"):
        graph_of(leaks, {"logprobs": 1})
    u = upload(dpo)
    u["graph"]["nodes"][5]["target"] = "os.system"
    u["graph"]["nodes"][5]["op"] = "call_function"
    with pytest.raises(InvalidRequestError, match="'os.system' is not allowed"):
        parse_graph(u["name"], u["inputs"], u["graph"])
    u = upload(dpo)
    u["graph"]["nodes"][5]["op"] = "call_module"
    with pytest.raises(InvalidRequestError, match="op 'call_module' is not allowed"):
        parse_graph(u["name"], u["inputs"], u["graph"])


def test_cyclic_and_oversized_graphs_are_refused():
    u = upload(dpo)
    nodes = u["graph"]["nodes"]
    nodes[4]["args"][0] = {"ref": nodes[6]["name"]}  # reads a later node: a cycle
    with pytest.raises(InvalidRequestError, match="not an earlier node"):
        parse_graph(u["name"], u["inputs"], u["graph"])
    u = upload(dpo)
    nodes = u["graph"]["nodes"]
    nodes[4]["args"][0] = {"ref": nodes[4]["name"]}  # reads itself
    with pytest.raises(InvalidRequestError, match="acyclic"):
        parse_graph(u["name"], u["inputs"], u["graph"])
    u = upload(dpo)
    body = u["graph"]["nodes"]
    filler = [
        {"op": "call_function", "name": f"n{i}", "target": "operator.neg",
         "args": [{"ref": "logprobs"}], "kwargs": {}}
        for i in range(MAX_NODES)
    ]  # fmt: skip
    u["graph"]["nodes"] = body[:4] + filler + body[4:]
    with pytest.raises(InvalidRequestError, match=f"limit of {MAX_NODES}"):
        parse_graph(u["name"], u["inputs"], u["graph"])


def test_a_graph_that_grows_its_tensors_is_refused_before_it_allocates():
    def blowup(logprobs):
        big = logprobs.reshape(-1, 1) * logprobs.reshape(1, -1)  # (T, T): broadcasting
        return big.sum(), {}

    graph = graph_of(blowup, {"logprobs": 1})
    check_cost(graph, [((64,), torch.float32)])  # 4096 cells: within the slack
    with pytest.raises(InvalidRequestError, match="over this server's bound"):
        check_cost(graph, [((100_000,), torch.float32)])  # 10^10 cells: never allocated
    lp = torch.zeros(1, 100_000, requires_grad=True)
    data = [TrainDatum(np.zeros(100_000, np.int64), {"target_tokens": np.zeros(100_000)})]
    with pytest.raises(InvalidRequestError, match="over this server's bound"):
        CustomLoss(graph).per_token(lp, data, [data[0].loss_inputs["target_tokens"]])


def test_datums_are_checked_against_the_declared_ranks():
    graph = graph_of(dpo)
    rng = np.random.default_rng(2)
    good = datum(rng, dpo, 6)
    validate_custom_batch(graph, [good], 50, 64)
    bad = TrainDatum(good.tokens, {**good.loss_inputs, "ref_margin": np.zeros(3, np.float32)})
    with pytest.raises(InvalidRequestError, match=r"'ref_margin'.*declared it with rank 0"):
        validate_custom_batch(graph, [bad], 50, 64)
    missing = TrainDatum(good.tokens, {"target_tokens": good.loss_inputs["target_tokens"]})
    with pytest.raises(InvalidRequestError, match="missing 'chosen_mask'"):
        validate_custom_batch(graph, [missing], 50, 64)
    nan = TrainDatum(good.tokens, {**good.loss_inputs, "chosen_mask": np.full(6, np.nan)})
    with pytest.raises(InvalidRequestError, match="finite"):
        validate_custom_batch(graph, [nan], 50, 64)


def test_a_non_scalar_loss_is_refused():
    def per_token(logprobs):
        return -logprobs, {}

    graph = graph_of(per_token, {"logprobs": 1})
    with pytest.raises(InvalidRequestError, match="must return a scalar"):
        run(graph, [torch.zeros(3)])
