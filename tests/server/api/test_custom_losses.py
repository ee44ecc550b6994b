"""Server-side custom losses through the official tinker SDK (create_custom_loss, then
forward_backward_custom with the LossHandle): DPO, "DPO + 0.1·NLL" and a KTO-style loss
give the same loss, metrics and gradients as the SDK's client-side path (a forward, the
loss on the client, a forward_backward with its gradients as weights), in one engine call
instead of two; a forbidden op or a cyclic graph is refused naming it; another tenant (and
another session) cannot use the loss.

Gradients are compared through an AdamW step that maps each gradient g to g / (|g| + 1)
(beta1 = beta2 = 0, eps = 1, learning rate 1): the adapters' weights after it differ by
no more than their gradients do, and both adapters start from the same seed.

    .venv/bin/python -m pytest -q tests/server/api/test_custom_losses.py
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _tenancy import TINY, Api, make_tenants

tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402

# g → g / (|g| + 1): a step that shows the gradient, smoothly (Adam with these settings)
GRADIENT_STEP = T.AdamParams(learning_rate=1.0, beta1=0.0, beta2=0.0, eps=1.0)


def dpo(logprobs, chosen_mask, rejected_mask, ref_margin):
    margin = (logprobs * chosen_mask).sum() - (logprobs * rejected_mask).sum() - ref_margin
    loss = -F.logsigmoid(0.5 * margin)
    return loss, {"custom/margin:mean": margin.detach(), "custom/won:sum": (margin > 0).float()}


def dpo_nll(logprobs, chosen_mask, rejected_mask, ref_margin):
    margin = (logprobs * chosen_mask).sum() - (logprobs * rejected_mask).sum() - ref_margin
    nll = -(logprobs * chosen_mask).sum() / chosen_mask.sum().clamp(min=1.0)
    return -F.logsigmoid(0.5 * margin) + 0.1 * nll, {"custom/nll:mean": nll}


def kto(logprobs, weights, ref_logprob, desirable):
    reward = (logprobs * weights).sum() - ref_logprob
    value = torch.where(desirable > 0, torch.sigmoid(0.3 * reward), torch.sigmoid(-0.3 * reward))
    return 1.0 - value, {"custom/reward:mean": reward}


RANKS = {
    dpo: {"logprobs": 1, "chosen_mask": 1, "rejected_mask": 1, "ref_margin": 0},
    dpo_nll: {"logprobs": 1, "chosen_mask": 1, "rejected_mask": 1, "ref_margin": 0},
    kto: {"logprobs": 1, "weights": 1, "ref_logprob": 0, "desirable": 0},
}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from _inproc import InProcessServer

    data = tmp_path_factory.mktemp("custom-losses")
    keys = make_tenants(data, {"alice": None, "bob": None})
    with InProcessServer({TINY: tiny_model_dir}, data) as srv:
        srv.keys = keys
        yield srv


@pytest.fixture(scope="module")
def vocab(tiny_model_dir) -> int:
    return json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]


def service(server, who: str = "alice"):
    return tinker.ServiceClient(base_url=server.url, api_key=server.keys[who])


def pair_data(rng, fn, vocab: int, n: int = 3) -> list[T.Datum]:
    """Datums of a pairwise loss: a chosen then a rejected answer in one sequence, their
    positions marked; or, for KTO, one answer with its label."""
    data = []
    for _ in range(n):
        L = int(rng.integers(10, 16))
        seq = rng.integers(0, vocab, L + 1).tolist()
        half = L // 2
        inputs: dict = {"target_tokens": seq[1:]}
        if fn is kto:
            inputs["weights"] = rng.uniform(0.2, 1.0, L).astype(np.float32).tolist()
            inputs["ref_logprob"] = T.TensorData(
                data=[float(rng.normal(-30, 2))], dtype="float32", shape=[]
            )
            inputs["desirable"] = T.TensorData(
                data=[float(rng.integers(0, 2))], dtype="float32", shape=[]
            )
        else:
            chosen = [1.0] * half + [0.0] * (L - half)
            inputs["chosen_mask"] = T.TensorData(data=chosen, dtype="float32", shape=[L])
            inputs["rejected_mask"] = T.TensorData(
                data=[1.0 - c for c in chosen], dtype="float32", shape=[L]
            )
            inputs["ref_margin"] = T.TensorData(
                data=[float(rng.normal(0, 3))], dtype="float32", shape=[]
            )
        data.append(T.Datum(model_input=T.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs))
    return data


def scored(data: list[T.Datum]) -> list[T.Datum]:
    """The same sequences, for a plain forward (its logprobs)."""
    return [
        T.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": [0.0] * d.model_input.length,
            },
        )
        for d in data
    ]


def adapter_weights(server, path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    run, _, name = path.removeprefix("tinker://").split("/")
    folder = server.data_dir.resolve() / "artifacts" / run / "sampler_weights" / name
    return load_file(str(folder / "adapter_model.safetensors"))


def kinds_of(server, model_id: str) -> list[str]:
    with sqlite3.connect(server.data_dir / "treadle.db") as db:
        rows = db.execute(
            "SELECT kind FROM requests WHERE model_id = ? ORDER BY seq_id", (model_id,)
        ).fetchall()
    return [k for (k,) in rows]


@pytest.mark.parametrize("fn", [dpo, dpo_nll, kto])
def test_server_side_equals_client_side(server, vocab, fn):
    svc = service(server)
    try:
        handle = svc.create_custom_loss(fn, RANKS[fn]).result(timeout=60)
        assert handle.loss_id is not None  # client/config says custom_loss_server_side
        local = dataclasses.replace(handle, loss_id=None)  # the same loss, run client-side
        data = pair_data(np.random.default_rng(7), fn, vocab)
        outs, weights, after = {}, {}, {}
        for how, h in (("server", handle), ("client", local)):
            tc = svc.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
            outs[how] = tc.forward_backward_custom(data, h).result(timeout=120)
            tc.optim_step(GRADIENT_STEP).result(timeout=60)
            path = tc.save_weights_for_sampler(f"{fn.__name__}-{how}").result(timeout=60).path
            weights[how] = adapter_weights(server, path)
            after[how] = tc.forward(scored(data), "cross_entropy").result(timeout=60)
            kinds = kinds_of(server, tc.model_id)
            train = [k for k in kinds if k in ("forward", "forward_backward")]
            # one engine call for the server-side loss; a forward, then a forward_backward
            assert train[:2] == (["forward_backward", "forward"] if how == "server" else
                                 ["forward", "forward_backward"]), (how, kinds)  # fmt: skip
        got, want = outs["server"].metrics, outs["client"].metrics
        assert got["loss:sum"] == pytest.approx(want["loss:sum"], rel=1e-6, abs=1e-6)
        for key in (k for k in want if k.startswith("custom/")):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key
        for a, b in zip(
            outs["server"].loss_fn_outputs, outs["client"].loss_fn_outputs, strict=True
        ):
            np.testing.assert_allclose(
                a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-6
            )
        assert weights["server"].keys() == weights["client"].keys()
        moved = 0.0
        for key, w in weights["server"].items():
            np.testing.assert_allclose(w, weights["client"][key], atol=1e-6, rtol=0, err_msg=key)
            moved = max(moved, float(np.abs(w).max()))
        assert moved > 1e-3  # the step moved the adapters (B starts at 0)
        for a, b in zip(
            after["server"].loss_fn_outputs, after["client"].loss_fn_outputs, strict=True
        ):
            np.testing.assert_allclose(
                a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-6
            )
    finally:
        svc.close("success").result(timeout=30)


def test_forbidden_ops_and_cycles_are_refused(server):
    api = Api(server.url, server.keys["alice"])
    sid = api.ok("create_session", {"tags": []})["session_id"]
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    def upload(fn, ranks, seq):
        g = json.loads(encode_graph(trace_loss(fn, ranks, sid)).model_dump_json())
        inputs = [{"name": k, "rank": r} for k, r in ranks.items()]
        return {"session_id": sid, "custom_loss_seq_id": seq, "name": fn.__name__,
                "inputs": inputs, "graph": g}  # fmt: skip

    def quadratic(logprobs):
        return torch.matmul(logprobs, logprobs), {}

    resp = api.post("create_custom_loss", upload(quadratic, {"logprobs": 1}, 0))
    assert resp.status_code == 400 and "torch.matmul" in resp.json()["error"], resp.text
    body = upload(dpo, RANKS[dpo], 1)
    nodes = body["graph"]["nodes"]
    nodes[4]["args"][0] = {"ref": nodes[-2]["name"]}  # a node reading a later one: a cycle
    resp = api.post("create_custom_loss", body)
    assert resp.status_code == 400 and "acyclic" in resp.json()["error"], resp.text
    body = upload(dpo, RANKS[dpo], 2)
    body["graph"]["nodes"][5] = {**body["graph"]["nodes"][5], "op": "call_module"}
    resp = api.post("create_custom_loss", body)
    assert resp.status_code == 400 and "call_module" in resp.json()["error"], resp.text
    body = upload(dpo, RANKS[dpo], 3)
    body["graph"]["nodes"] = body["graph"]["nodes"] * 200
    resp = api.post("create_custom_loss", body)
    assert resp.status_code == 400 and "limit" in resp.json()["error"], resp.text
    api.close()


def test_another_tenant_or_session_cannot_use_the_loss(server, vocab):
    svc = service(server)
    other = service(server, "bob")
    mine_too = service(server)
    try:
        handle = svc.create_custom_loss(dpo, RANKS[dpo]).result(timeout=60)
        data = pair_data(np.random.default_rng(1), dpo, vocab, n=1)
        for who in (other, mine_too):  # another tenant; the same tenant's other session
            tc = who.create_lora_training_client(base_model=TINY, rank=2).result()
            with pytest.raises(Exception, match="not found in this session"):
                tc.forward_backward(data, "custom", {"loss_id": handle.loss_id}).result(timeout=60)
            # the refused request held its seq_id: the next one runs
            tc.forward(scored(data), "cross_entropy").result(timeout=60)
        # and no route reads a loss back: the id is not a request, a sampler, a checkpoint
        api = Api(server.url, server.keys["bob"])
        resp = api.post("retrieve_future", {"request_id": handle.loss_id})
        assert resp.status_code == 404
        api.close()
    finally:
        for s in (svc, other, mine_too):
            s.close("success").result(timeout=30)
