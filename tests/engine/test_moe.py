"""Mixture-of-experts bases (gpt-oss, Qwen3-MoE) with LoRA on the routed experts, against
independent computations: plain transformers, peft's `target_parameters`, separate passes,
and a twin of a poisoned adapter. Every test runs on both tiny architectures (moe_dir).

    .venv/bin/python -m pytest -q tests/engine/test_moe.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from treadle.engine.tiny import SLIDING_WINDOW
from treadle.engine.types import AdamSpec, LoraSpec, TrainBatch, TrainDatum

EXPERTS_ONLY = dict(train_attn=False, train_unembed=False)


def _random_b(adapter, seed: int, std: float = 0.1) -> None:
    """Random B: the adapter changes the output and every A gets a gradient."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pair in adapter.layers.values():
            pair.B.copy_(torch.randn(pair.B.shape, generator=gen) * std)


def _ids(engine, B: int, T: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.vocab_size, (B, T), generator=gen)  # (B, T)


def _logits(engine, keys: list, ids: torch.Tensor) -> torch.Tensor:
    with engine.bank.rows(keys):
        return engine.model(input_ids=ids).logits  # (B, T, V)


def _grads(engine, aid: str) -> list[torch.Tensor]:
    return [p.grad.clone() for p in engine.bank.live(aid).parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Equal to fp32 rounding (the same sums in another batch layout)."""
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5 * max(1.0, y.abs().max().item()))


# ---- the architectures and what LoRA targets on them ----
def test_tiny_moe_is_the_real_architecture(moe_dir, moe_engine):
    config = AutoConfig.from_pretrained(moe_dir)
    bank, L = moe_engine.bank, config.num_hidden_layers
    assert config.num_experts > 2 and 1 < config.num_experts_per_tok < config.num_experts
    if config.model_type == "gpt_oss":  # alternating sliding / full attention, with sinks
        assert config.layer_types == ["sliding_attention", "full_attention"] * (L // 2)
        assert config.sliding_window == SLIDING_WINDOW
        assert all(
            f"model.layers.{i}.self_attn.sinks" in dict(moe_engine.model.named_parameters())
            for i in range(L)
        )
    # every layer's fused experts are targets, one update per expert
    assert sorted(bank.experts) == sorted(
        f"model.layers.{i}.mlp.experts.{n}" for i in range(L) for n in ("down_proj", "gate_up_proj")
    )
    assert all(p.num_experts == config.num_experts for p in bank.experts.values())
    # train_mlp means the experts here; the router is never a target
    mlp = bank.target_paths(LoraSpec(**EXPERTS_ONLY))
    assert mlp == sorted(bank.experts)
    attn = bank.target_paths(LoraSpec(train_mlp=False, train_unembed=False))
    assert {p.rsplit(".", 1)[-1] for p in attn} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert bank.target_paths(LoraSpec(train_mlp=False, train_attn=False)) == ["lm_head"]
    assert not any("router" in p or ".gate." in p for p in bank.targets)
    moe_engine.create_adapter("shapes", LoraSpec(rank=3, **EXPERTS_ONLY))
    pair = moe_engine.bank.live("shapes").layers["model.layers.0.mlp.experts.gate_up_proj"]
    E, H = config.num_experts, config.hidden_size
    assert pair.A.shape == (E, 3, H) and pair.B.shape[::2] == (E, 3)
    moe_engine.drop_adapter("shapes")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_other_moe_families_adapt_their_experts_as_peft(family, tmp_path):
    """Any transformers-5 MoE (fused experts): Mixtral, Qwen2-MoE with its shared expert,
    whose gate, like every router, is no target. Engine and peft on the same adapter agree."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig

    from treadle.engine.checkpoints import read_adapter
    from treadle.engine.lora import AdapterBank

    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
    )  # fmt: skip
    config = (
        MixtralConfig(num_local_experts=4, **common)
        if family == "mixtral"
        else Qwen2MoeConfig(
            num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, **common
        )
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval().requires_grad_(False)
    bank = AdapterBank(model)
    assert len(bank.experts) == 4  # gate_up_proj and down_proj of both layers
    gates = [n for n, _ in model.named_modules() if n.endswith(("gate", "router"))]
    assert gates and not set(gates) & set(bank.targets)
    lora = LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), lora)
    peft_model.save_pretrained(tmp_path / "adapter")
    spec, weights, scales = read_adapter(tmp_path / "adapter", bank)
    bank.add("a", spec, weights, scales)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), bank.rows(["a", "a"]):
        ours = model(input_ids=ids).logits
    with torch.no_grad():
        torch.testing.assert_close(ours, peft_model(input_ids=ids).logits, rtol=1e-5, atol=2e-5)


def test_fresh_adapter_equals_plain_transformers(moe_engine, moe_plain, moe_datum, helpers, new_id):
    aid = new_id()
    moe_engine.create_adapter(aid, LoraSpec(rank=4, seed=1))
    data = [moe_datum(T, seed=T) for T in (SLIDING_WINDOW + 9, 7, 12)]  # padded rows
    (res,) = moe_engine.forward_backward([TrainBatch(aid, data)], forward_only=True)
    for d, out in zip(data, res.outputs, strict=True):
        want = helpers.plain_logprobs(moe_plain, d.tokens, d.loss_inputs["target_tokens"])
        np.testing.assert_allclose(out["logprobs"], want.numpy(), atol=2e-4, rtol=0)
    moe_engine.drop_adapter(aid)


@pytest.mark.parametrize("attention", [False, True])
def test_expert_lora_equals_peft_target_parameters(
    moe_dir, moe_engine, new_id, tmp_path, attention
):
    """peft builds and initialises the adapter (random B too), saves it in its own layout; the
    engine imports it, and both give the same logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "o_proj"] if attention else [],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,  # random lora_B: the update is not zero
    )
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(moe_dir), config).eval()
    with torch.no_grad():  # peft's random B is large: scale it to an adapter's size
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.2)
    peft_model.save_pretrained(tmp_path)
    aid = new_id()
    moe_engine.load_adapter(aid, tmp_path)
    layers = moe_engine.bank.live(aid).layers
    assert set(layers) == set(moe_engine.bank.experts) | (
        {p for p in moe_engine.bank.targets if p.endswith(("q_proj", "o_proj"))}
        if attention
        else set()
    )
    ids = _ids(moe_engine, 3, SLIDING_WINDOW + 8)
    with torch.no_grad():
        ours = _logits(moe_engine, [aid] * 3, ids)
        theirs = peft_model(input_ids=ids).logits
        base = _logits(moe_engine, [None] * 3, ids)
    assert (ours - base).abs().max() > 0.1  # the experts' update really changes the output
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=2e-5)
    moe_engine.drop_adapter(aid)


def test_expert_lora_gradients_equal_peft(moe_dir, moe_engine, moe_datum, new_id, tmp_path):
    """The same adapter in peft and in the engine, the same weighted cross-entropy: the
    gradients of every expert's A and B agree (peft's lora_A (r*E, in) and lora_B
    (out, r*E) hold expert e's rows e*r.. and columns j*E + e)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    names = ["gate_up_proj", "down_proj"]
    config = LoraConfig(
        r=2, lora_alpha=4, target_modules=[], init_lora_weights=False,
        target_parameters=[f"mlp.experts.{n}" for n in names],
    )  # fmt: skip
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(moe_dir), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.2)
    peft_model.save_pretrained(tmp_path)
    aid = new_id()
    moe_engine.load_adapter(aid, tmp_path)
    data = [moe_datum(T, seed=T) for T in (SLIDING_WINDOW + 5, 6)]
    moe_engine.forward_backward([TrainBatch(aid, data)])
    for d in data:  # the engine's loss: -sum(weights * logprobs of the targets)
        logp = peft_model(input_ids=torch.as_tensor(d.tokens)[None]).logits[0].log_softmax(-1)
        targets = torch.as_tensor(d.loss_inputs["target_tokens"])[:, None]
        w = torch.as_tensor(d.loss_inputs["weights"])
        (-(logp.gather(-1, targets)[:, 0] * w).sum()).backward()
    params = dict(peft_model.named_parameters())
    E = moe_engine.bank.experts["model.layers.0.mlp.experts.down_proj"].num_experts
    for path, pair in moe_engine.bank.live(aid).layers.items():
        module, name = path.rsplit(".", 1)
        nest = ".base_layer" if name == "gate_up_proj" else ""  # peft wraps gate_up first
        grad_a = params[f"base_model.model.{module}{nest}.lora_A.default.weight"].grad
        grad_b = params[f"base_model.model.{module}{nest}.lora_B.default.weight"].grad
        want_a = grad_a.reshape(E, -1, grad_a.shape[1])  # (E, r, in)
        want_b = grad_b.reshape(grad_b.shape[0], -1, E).permute(2, 0, 1)  # (E, out, r)
        _close([pair.A.grad, pair.B.grad], [want_a, want_b])
        assert pair.A.grad.abs().max() > 0 and pair.B.grad.abs().max() > 0
    moe_engine.drop_adapter(aid)


# ---- training ----
def test_mixed_batch_equals_separate_passes(moe_engine, moe_datum, new_id):
    """Rows of three adapters (experts + attention, attention only, experts only), one of them
    in two places: one pass with gradients equals one pass per adapter."""
    specs = [
        LoraSpec(rank=2, alpha=4, seed=1),
        LoraSpec(rank=8, alpha=8, seed=2, train_mlp=False),
        LoraSpec(rank=4, alpha=16, seed=3, **EXPERTS_ONLY),
    ]
    ids = [new_id() for _ in specs]
    for k, (aid, spec) in enumerate(zip(ids, specs, strict=True)):
        moe_engine.create_adapter(aid, spec)
        _random_b(moe_engine.bank.live(aid), seed=k)
    a, b, c = ids
    keys = [a, b, c, a]
    data = [moe_datum(T, seed=k) for k, T in enumerate((SLIDING_WINDOW + 4, 9, 13, 5))]
    mixed = moe_engine.forward_backward(
        [TrainBatch(k, [d]) for k, d in zip(keys, data, strict=True)]
    )
    mixed_grads = {aid: _grads(moe_engine, aid) for aid in ids}
    for aid in ids:
        for p in moe_engine.bank.live(aid).parameters():
            p.grad = None
    alone = {
        aid: moe_engine.forward_backward(
            [TrainBatch(aid, [d for k, d in zip(keys, data, strict=True) if k == aid])]
        )[0]
        for aid in ids
    }
    for aid in ids:
        _close(mixed_grads[aid], _grads(moe_engine, aid))
        assert all(g.abs().max() > 0 for g in mixed_grads[aid])  # the experts' A and B too
    want = [alone[a].outputs[0], alone[b].outputs[0], alone[c].outputs[0], alone[a].outputs[1]]
    for got, expected in zip(mixed, want, strict=True):
        np.testing.assert_allclose(
            got.outputs[0]["logprobs"], expected["logprobs"], rtol=1e-5, atol=1e-5
        )
    for aid in ids:
        moe_engine.drop_adapter(aid)


def test_sft_on_the_experts_alone_lowers_the_loss(moe_engine, new_id):
    """Only the experts' LoRA trains (no attention, no lm_head): the loss still falls, and
    the base (router included) is untouched."""
    aid = new_id()
    moe_engine.create_adapter(aid, LoraSpec(rank=8, alpha=16, seed=0, **EXPERTS_ONLY))
    router = {
        n: p.clone()
        for n, p in moe_engine.model.named_parameters()
        if "router" in n or ".gate." in n
    }
    data = []
    for text in [
        "Max has 3 apples. He finds 2 more. Answer: 5",
        "Hello! How can I help you today?",
    ]:
        seq = np.asarray(moe_engine.tokenizer(text)["input_ids"])
        data.append(
            TrainDatum(
                seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(len(seq) - 1, np.float32)}
            )
        )
    losses = []
    for _ in range(15):
        (res,) = moe_engine.forward_backward([TrainBatch(aid, data)])
        moe_engine.optim_step(aid, AdamSpec(learning_rate=1e-2, beta2=0.99))
        losses.append(res.metrics["loss:sum"])
    assert losses[-1] < 0.5 * losses[0], losses
    assert router and all(
        torch.equal(p, dict(moe_engine.model.named_parameters())[n]) for n, p in router.items()
    )
    assert not any(p.requires_grad for p in moe_engine.model.parameters())
    moe_engine.drop_adapter(aid)


# ---- isolation ----
@pytest.fixture
def tenants(moe_engine, new_id):
    """good (experts + attention), other (attention only), bad (experts only, poisoned by the
    test) and healthy: bad's twin, the same shapes, never poisoned."""
    ids = {name: new_id(name) for name in ("good", "other", "bad", "healthy")}
    specs = {
        "good": LoraSpec(rank=4, seed=1),
        "other": LoraSpec(rank=8, seed=2, train_mlp=False, train_unembed=False),
        "bad": LoraSpec(rank=4, seed=3, **EXPERTS_ONLY),
        "healthy": LoraSpec(rank=4, seed=3, **EXPERTS_ONLY),
    }
    for name, aid in ids.items():
        moe_engine.create_adapter(aid, specs[name])
        seed = {"good": 0, "other": 1, "bad": 2, "healthy": 2}[name]  # the twin's very weights
        _random_b(moe_engine.bank.live(aid), seed=seed)
    yield ids
    for aid in ids.values():
        moe_engine.drop_adapter(aid)


@pytest.mark.parametrize("how", ["nan_B", "huge"])
@pytest.mark.parametrize("grad", [False, True])  # a sampler's pass, a trainer's pass
@pytest.mark.parametrize("T", [1, 5, SLIDING_WINDOW + 4])
def test_poisoned_expert_adapter_leaves_other_rows_bit_identical(moe_engine, tenants, how, grad, T):
    bad, healthy = tenants["bad"], tenants["healthy"]
    keys = [tenants[k] if k else None for k in ["good", "bad", None, "other", "bad", "good", None]]
    ids = _ids(moe_engine, len(keys), T, seed=T)
    with torch.no_grad():
        for pair in moe_engine.bank.live(bad).layers.values():  # every expert of every layer
            if how == "nan_B":
                pair.B[:, 0, 0] = float("nan")
            else:  # finite weights whose product overflows
                pair.A.fill_(1e30)
                pair.B.fill_(1e30)
    with torch.set_grad_enabled(grad):
        mixed = _logits(moe_engine, keys, ids).detach()
        twin = _logits(moe_engine, [healthy if k == bad else k for k in keys], ids).detach()
        base = _logits(moe_engine, [None] * len(keys), ids).detach()
    assert not torch.isfinite(mixed[keys.index(bad)]).all()  # the poison works
    for row, key in enumerate(keys):
        if key == bad:
            continue
        assert torch.equal(mixed[row], twin[row]), (row, key)
        if key is None:  # the exact base output
            assert torch.equal(mixed[row], base[row]), row
