"""AdapterBank: fresh adapters equal the base, rows route to their own adapter, snapshots,
and the merged-weight path of high-rank adapters equals peft's low-rank product."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from treadle.engine import lora
from treadle.engine.lora import DECODE_MAX_TOKENS, AdapterBank, merge_is_cheaper
from treadle.engine.types import AdamSpec, LoraSpec, TrainBatch
from treadle.errors import ConflictError, InvalidRequestError, NotFoundError


def _ids(engine, B: int = 4, T: int = 9, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.vocab_size, (B, T), generator=gen)  # (B, T)


@torch.no_grad()
def test_fresh_adapter_equals_plain_transformers(engine, plain_model, new_id):
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=8, seed=3))
    ids = _ids(engine)
    reference = plain_model(input_ids=ids).logits.log_softmax(-1)  # (B, T, V)
    with engine.bank.rows([aid] * ids.shape[0]):
        ours = engine.model(input_ids=ids).logits.log_softmax(-1)
    assert torch.equal(ours, reference)
    engine.drop_adapter(aid)


def test_init_is_peft_default_and_seeded(engine, new_id):
    a, b, c = new_id(), new_id(), new_id()
    engine.create_adapter(a, LoraSpec(rank=4, seed=11))
    engine.create_adapter(b, LoraSpec(rank=4, seed=11))
    engine.create_adapter(c, LoraSpec(rank=4, seed=12))
    la, lb, lc = (engine.bank.live(x).layers for x in (a, b, c))
    for path in la:
        assert torch.equal(la[path].A, lb[path].A)
        assert not torch.equal(la[path].A, lc[path].A)
        assert torch.count_nonzero(la[path].B) == 0
        # kaiming_uniform(a=sqrt(5)) draws from U(-1/sqrt(in), 1/sqrt(in))
        bound = 1 / math.sqrt(la[path].A.shape[1])
        assert la[path].A.abs().max() <= bound
        assert la[path].A.abs().max() > 0.8 * bound
    for x in (a, b, c):
        engine.drop_adapter(x)


def test_scale_is_alpha_over_rank(engine, new_id):
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=8, alpha=4.0))
    assert {p.scale for p in engine.bank.live(aid).layers.values()} == {0.5}
    engine.drop_adapter(aid)


@pytest.mark.parametrize(
    "flags, kinds",
    [
        ((True, False, False), {"attn"}),
        ((False, True, False), {"mlp"}),
        ((False, False, True), {"unembed"}),
        ((True, True, True), {"attn", "mlp", "unembed"}),
    ],
)
def test_train_flags_choose_modules(engine, new_id, flags, kinds):
    aid = new_id()
    spec = LoraSpec(rank=2, train_attn=flags[0], train_mlp=flags[1], train_unembed=flags[2])
    engine.create_adapter(aid, spec)
    layers = engine.bank.live(aid).layers
    assert {engine.bank.targets[p] for p in layers} == kinds
    names = {p.rsplit(".", 1)[-1] for p in layers}
    expected = set()
    if flags[0]:
        expected |= {"q_proj", "k_proj", "v_proj", "o_proj"}
    if flags[1]:
        expected |= {"gate_proj", "up_proj", "down_proj"}
    if flags[2]:
        expected |= {"lm_head"}
    assert names == expected
    engine.drop_adapter(aid)


def test_memory_is_adapter_only(engine, new_id):
    n_base = sum(p.numel() for p in engine.model.parameters())
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=4))
    adapter = engine.bank.live(aid)
    expected = sum(
        4 * (engine.bank.modules[p].in_features + engine.bank.modules[p].out_features)
        for p in adapter.layers
    )
    assert adapter.num_params() == expected
    assert sum(p.numel() for p in engine.model.parameters()) == n_base
    engine.drop_adapter(aid)


@pytest.mark.parametrize("T", [1, 5, 9])  # decode-short rows take the all-adapters matmul
@torch.no_grad()
def test_mixed_rows_equal_single_adapter_passes(engine, helpers, new_id, T):
    a, b, c = new_id(), new_id(), new_id()
    engine.create_adapter(a, LoraSpec(rank=2, seed=1))
    engine.create_adapter(b, LoraSpec(rank=8, seed=2, train_mlp=False))
    engine.create_adapter(c, LoraSpec(rank=4, seed=3, train_unembed=False))
    for i, x in enumerate((a, b, c)):
        helpers.perturb(engine.bank.live(x), seed=i)
    ids = _ids(engine, B=5, T=T)
    keys = [a, b, None, c, a]
    with engine.bank.rows(keys):
        mixed = engine.model(input_ids=ids).logits  # (5, T, V)
    base = engine.model(input_ids=ids).logits  # outside rows(): the base model
    for row, key in enumerate(keys):
        if key is None:
            torch.testing.assert_close(mixed[row], base[row], rtol=0, atol=1e-5)
            continue
        with engine.bank.rows([key] * 5):
            alone = engine.model(input_ids=ids).logits
        torch.testing.assert_close(mixed[row], alone[row], rtol=1e-5, atol=1e-5)
        with engine.bank.rows(keys):  # the same route twice: cached stacks stay right
            engine.model(input_ids=ids)
            again = engine.model(input_ids=ids).logits
        torch.testing.assert_close(again[row], alone[row], rtol=1e-5, atol=1e-5)
        assert (alone[row] - base[row]).abs().max() > 1e-3  # the adapter does something
    for x in (a, b, c):
        engine.drop_adapter(x)


def test_stacked_weights_follow_every_change_of_their_adapters(engine, helpers, sft_datum, new_id):
    """The grouped path keeps its stacked weights from one rows() context to the next; an
    optimizer step, an in-place write and an adapter recreated under the same id must each
    show in the next mixed call, exactly as in a call of that adapter alone."""
    a, b = new_id(), new_id()
    engine.create_adapter(a, LoraSpec(rank=4, seed=1))
    engine.create_adapter(b, LoraSpec(rank=8, seed=2))
    helpers.perturb(engine.bank.live(a), seed=1)
    helpers.perturb(engine.bank.live(b), seed=2)
    keys = [a, b, b, None]

    def check(T: int) -> None:
        ids = _ids(engine, B=4, T=T)
        with torch.no_grad():
            with engine.bank.rows(keys):
                mixed = engine.model(input_ids=ids).logits  # (4, T, V)
            for row, key in enumerate(keys[:3]):
                with engine.bank.rows([key] * 4):
                    alone = engine.model(input_ids=ids).logits
                torch.testing.assert_close(mixed[row], alone[row], rtol=1e-5, atol=3e-5)

    for T in (1, 6):
        check(T)  # stacks built
    engine.forward_backward([TrainBatch(a, [sft_datum(8, seed=3)])])
    engine.optim_step(a, AdamSpec(learning_rate=0.05))
    for T in (1, 6):
        check(T)
    helpers.perturb(engine.bank.live(b), seed=7)  # an in-place copy_, as a restore does
    check(1)
    engine.drop_adapter(a)
    engine.create_adapter(a, LoraSpec(rank=4, seed=5))
    helpers.perturb(engine.bank.live(a), seed=5)
    check(1)
    for x in (a, b):
        engine.drop_adapter(x)


@torch.no_grad()
def test_stacked_weights_are_kept_within_their_budget(engine, helpers, new_id):
    """The last two sets of adapters are kept, and a set larger than the byte budget is
    stacked anew for each call (the same numbers either way)."""
    ids = [new_id() for _ in range(4)]
    for i, x in enumerate(ids):
        engine.create_adapter(x, LoraSpec(rank=4, seed=i))
        helpers.perturb(engine.bank.live(x), seed=i)
    stacks, tokens = engine.bank.stacks, _ids(engine, B=2, T=1)

    def mixed(keys: list) -> torch.Tensor:
        with engine.bank.rows(keys):
            return engine.model(input_ids=tokens).logits  # (2, 1, V)

    stacks.clear()
    first = mixed(ids[:2])
    for pair in (ids[1:3], ids[2:4]):
        mixed(pair)
    assert len(stacks) == 2 and stacks.nbytes > 0  # the oldest set went
    budget, stacks.max_bytes = stacks.max_bytes, stacks.nbytes // 4
    try:
        again = mixed(ids[:2])
        assert len(stacks) <= 2 and stacks.nbytes <= stacks.max_bytes
        assert torch.equal(first, again)
    finally:
        stacks.max_bytes = budget
    for x in ids:
        engine.drop_adapter(x)
    assert len(stacks) == 0  # dropping an adapter lets go of its copies


@torch.no_grad()
def test_tied_embedding_untouched_by_unembed_lora(engine, helpers, new_id):
    emb = engine.model.get_input_embeddings().weight
    before = emb.clone()
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=4, train_attn=False, train_mlp=False))
    helpers.perturb(engine.bank.live(aid), seed=5)
    ids = _ids(engine)
    with engine.bank.rows([aid] * 4):
        engine.model(input_ids=ids)
    assert torch.equal(emb, before)
    assert engine.model.get_output_embeddings().weight is emb
    engine.drop_adapter(aid)


@torch.no_grad()
def test_snapshot_is_a_frozen_copy(engine, helpers, new_id):
    aid, sid = new_id(), new_id("snap")
    engine.create_adapter(aid, LoraSpec(rank=4, seed=7))
    helpers.perturb(engine.bank.live(aid), seed=7)
    ids = _ids(engine, B=2)
    with engine.bank.rows([aid, aid]):
        before = engine.model(input_ids=ids).logits
    engine.snapshot(aid, sid)
    snap = engine.bank.snapshots[sid]
    assert all(not t.requires_grad for t in snap.parameters())
    helpers.perturb(engine.bank.live(aid), seed=8)  # the live adapter moves on
    with engine.bank.rows([sid, aid]):
        mixed = engine.model(input_ids=ids).logits
    torch.testing.assert_close(mixed[0], before[0], rtol=1e-5, atol=1e-5)
    assert (mixed[1] - before[1]).abs().max() > 1e-3
    engine.drop_adapter(aid)  # snapshots outlive their adapter
    with engine.bank.rows([sid, None]):
        again = engine.model(input_ids=ids).logits
    torch.testing.assert_close(again[0], before[0], rtol=1e-5, atol=1e-5)
    engine.drop_snapshot(sid)
    with pytest.raises(NotFoundError, match=sid):
        with engine.bank.rows([sid]):
            pass


def test_bank_errors(engine, new_id):
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=2))
    with pytest.raises(ConflictError, match=aid):
        engine.create_adapter(aid, LoraSpec(rank=2))
    with pytest.raises(ConflictError, match=aid):
        engine.snapshot(aid, aid)
    with pytest.raises(NotFoundError, match="nope"):
        engine.snapshot("nope", new_id())
    with pytest.raises(InvalidRequestError, match="rank must be an integer >= 1, got 0"):
        engine.create_adapter(new_id(), LoraSpec(rank=0))
    with pytest.raises(InvalidRequestError, match="trains nothing"):
        engine.create_adapter(
            new_id(), LoraSpec(train_attn=False, train_mlp=False, train_unembed=False)
        )
    with pytest.raises(RuntimeError, match="rows"):
        with engine.bank.rows([aid, aid]), torch.no_grad():
            engine.model(input_ids=_ids(engine, B=3))
    engine.drop_adapter(aid)
    with pytest.raises(NotFoundError):
        engine.drop_adapter(aid)


# ---- merged path: one adapter of high rank ----
# rank 128 on the tiny model (width 128): rank*(in+out) > in*out / 3 on every layer, so a
# training call of a few hundred tokens merges everywhere (see merge_is_cheaper)
HIGH_RANK = 128
_MERGED_WEIGHT = lora._merged_weight


def _spy_merges(monkeypatch, model) -> list[str]:
    """Record the layers that build a merged weight (the real function still runs)."""
    module_paths = list(model.named_modules())
    seen: list[str] = []
    real = _MERGED_WEIGHT  # not a spy installed earlier in the same test

    def spy(module, pair):
        seen.append(next(p for p, m in module_paths if m is module))
        return real(module, pair)

    monkeypatch.setattr(lora, "_merged_weight", spy)
    return seen


def _run(engine, batches: list[TrainBatch], merge: bool) -> tuple[list, dict]:
    """forward_backward with merging on or off: per-batch logprobs and every LoRA gradient."""
    adapters = {b.adapter_id: engine.bank.live(b.adapter_id) for b in batches}
    for adapter in adapters.values():
        for p in adapter.parameters():
            p.grad = None
    engine.bank.merge_when_cheaper = merge
    try:
        results = engine.forward_backward(batches)
    finally:
        engine.bank.merge_when_cheaper = True
    logprobs = [[torch.from_numpy(o["logprobs"]) for o in r.outputs] for r in results]
    grads = {
        (key, path, name): getattr(pair, name).grad.clone()
        for key, adapter in adapters.items()
        for path, pair in adapter.layers.items()
        for name in ("A", "B")
    }
    return logprobs, grads


def perturb_B(adapter, seed: int) -> None:
    """B ~ N(0, 0.02^2): for engines and banks other than the session fixture's."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pair in adapter.layers.values():
            pair.B.copy_(torch.randn(pair.B.shape, generator=gen) * 0.02)


@torch.no_grad()
def _logits(engine, keys: list, ids: torch.Tensor, merge: bool) -> torch.Tensor:
    engine.bank.merge_when_cheaper = merge
    try:
        with engine.bank.rows(keys):
            return engine.model(input_ids=ids).logits  # (B, T, V)
    finally:
        engine.bank.merge_when_cheaper = True


def test_merge_rule_forward_only_is_a_token_count():
    # merged r*io + N*io against N*(io + r*(in+out)): N > in*out/(in+out), whatever the rank
    for rank in (1, 8, 128):
        assert not merge_is_cheaper(64, 128, 128, rank, False, False)  # 128*128/256: a tie
        assert merge_is_cheaper(65, 128, 128, rank, False, False)
    assert not merge_is_cheaper(42, 128, 64, 4, False, False)  # 128*64/192 = 42.7
    assert merge_is_cheaper(43, 128, 64, 4, False, False)


def test_merge_rule_training_is_a_rank_threshold():
    # both gradients, long batches: 3*rank*(in+out) > in*out, so rank 22 and up at 128 x 128
    n = 10**9
    assert not merge_is_cheaper(n, 128, 128, 21, True, True)
    assert merge_is_cheaper(n, 128, 128, 22, True, True)
    assert not merge_is_cheaper(n, 128, 512, 34, True, True)  # 3*34*640 = 65280 < 65536
    assert merge_is_cheaper(n, 128, 512, 35, True, True)
    # a short call does not repay B @ A and the two matmuls of its gradient: N > 76.8 here
    assert not merge_is_cheaper(76, 128, 128, 128, True, True)
    assert merge_is_cheaper(77, 128, 128, 128, True, True)


def test_merged_path_equals_peft_and_leaves_tied_embedding(
    engine, model_dir, helpers, sft_datum, new_id, monkeypatch
):
    """Values and LoRA gradients of the merged path equal peft's (and our unmerged path's)
    with lm_head on the tied embedding, which an optimizer step leaves untouched."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=HIGH_RANK, alpha=64.0, seed=9))
    adapter = engine.bank.live(aid)
    helpers.perturb(adapter, seed=9)
    data = [sft_datum(60, seed=100 + i) for i in range(4)]  # 240 tokens per layer call
    merged_in = _spy_merges(monkeypatch, engine.model)
    lp_merged, g_merged = _run(engine, [TrainBatch(aid, data)], merge=True)
    assert sorted(set(merged_in)) == sorted(adapter.layers)  # every layer merged, lm_head too
    merged_in.clear()
    lp_plain, g_plain = _run(engine, [TrainBatch(aid, data)], merge=False)
    assert not merged_in

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    names = sorted({p.rsplit(".", 1)[-1] for p in adapter.layers})
    config = LoraConfig(r=HIGH_RANK, lora_alpha=64.0, target_modules=names, lora_dropout=0.0)
    peft_model = get_peft_model(base, config)
    peft_model.eval()
    inner = peft_model.base_model.model
    with torch.no_grad():
        for path, pair in adapter.layers.items():
            inner.get_submodule(path).lora_A["default"].weight.copy_(pair.A)
            inner.get_submodule(path).lora_B["default"].weight.copy_(pair.B)
    total = torch.zeros(())
    for i, d in enumerate(data):
        lp = helpers.plain_logprobs(peft_model, d.tokens, d.loss_inputs["target_tokens"])
        total = total - (lp * torch.as_tensor(d.loss_inputs["weights"])).sum()
        torch.testing.assert_close(lp_merged[0][i], lp.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lp_merged[0][i], lp_plain[0][i], rtol=1e-5, atol=1e-5)
    total.backward()
    for path in adapter.layers:
        module = inner.get_submodule(path)
        for name, theirs in (("A", module.lora_A), ("B", module.lora_B)):
            ours, ref = g_merged[(aid, path, name)], theirs["default"].weight.grad
            atol = 1e-5 * float(ref.abs().max())  # fp32 sums over 240 tokens, rank 128
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=atol)
            torch.testing.assert_close(ours, g_plain[(aid, path, name)], rtol=1e-4, atol=atol)
    assert not torch.equal(g_merged[(aid, "lm_head", "A")], g_plain[(aid, "lm_head", "A")])

    emb = engine.model.get_input_embeddings().weight
    before = emb.clone()
    _run(engine, [TrainBatch(aid, data)], merge=True)
    engine.optim_step(aid, AdamSpec(learning_rate=1e-2))
    assert torch.equal(emb, before) and emb.grad is None
    assert engine.model.get_output_embeddings().weight is emb
    # after the step (B moved everywhere) both paths still agree, forward only
    merged = engine.forward_backward([TrainBatch(aid, data)], forward_only=True)[0]
    engine.bank.merge_when_cheaper = False
    try:
        plain = engine.forward_backward([TrainBatch(aid, data)], forward_only=True)[0]
    finally:
        engine.bank.merge_when_cheaper = True
    for a, b in zip(merged.outputs, plain.outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-5)
    engine.drop_adapter(aid)


def test_mixed_batches_and_decode_calls_never_merge(
    engine, helpers, sft_datum, new_id, monkeypatch
):
    a, b = new_id(), new_id()
    engine.create_adapter(a, LoraSpec(rank=HIGH_RANK, seed=1))
    engine.create_adapter(b, LoraSpec(rank=HIGH_RANK, seed=2, train_unembed=False))
    helpers.perturb(engine.bank.live(a), seed=1)
    helpers.perturb(engine.bank.live(b), seed=2)
    batches = [TrainBatch(a, [sft_datum(60, seed=1)] * 2), TrainBatch(b, [sft_datum(60, seed=2)])]
    merged_in = _spy_merges(monkeypatch, engine.model)
    lp_on, g_on = _run(engine, batches, merge=True)
    lp_off, g_off = _run(engine, batches, merge=False)
    assert not merged_in
    assert all(torch.equal(x, y) for x, y in zip(sum(lp_on, []), sum(lp_off, []), strict=True))
    assert all(torch.equal(g_on[k], g_off[k]) for k in g_on)
    # each batch alone takes the merged path and gives the mixed pass's numbers
    lp_alone, _ = _run(engine, batches[:1], merge=True)
    assert merged_in
    torch.testing.assert_close(lp_alone[0][1], lp_on[0][1], rtol=1e-5, atol=1e-5)

    merged_in.clear()
    ids = _ids(engine, B=64, T=DECODE_MAX_TOKENS)  # 512 tokens, but decode-sized rows
    short = _logits(engine, [a] * 64, ids, merge=True)  # (64, 8, V)
    assert not merged_in
    assert torch.equal(short, _logits(engine, [a] * 64, ids, merge=False))
    ids = _ids(engine, B=8, T=40)  # a prefill: 320 tokens per call merge, even forward only
    prefill = _logits(engine, [a] * 8, ids, merge=True)
    assert sorted(set(merged_in)) == sorted(engine.bank.live(a).layers)
    unmerged = _logits(engine, [a] * 8, ids, merge=False)
    torch.testing.assert_close(prefill, unmerged, rtol=1e-5, atol=1e-5)
    mixed = _logits(engine, [a] * 4 + [b] * 4, ids, merge=True)
    torch.testing.assert_close(mixed[:4], prefill[:4], rtol=1e-5, atol=1e-5)
    engine.drop_adapter(a)
    engine.drop_adapter(b)


def test_merged_path_on_a_bf16_base_matches_unmerged_numerics(model_dir, sft_datum, monkeypatch):
    """Merging in the base dtype adds no more error than the bf16 base matmul already does:
    both paths measured against the same adapter on the fp32 base."""
    from treadle.engine import Engine

    data = [sft_datum(60, seed=200 + i) for i in range(4)]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        eng = Engine(model_dir, dtype=dtype)
        eng.create_adapter("hr", LoraSpec(rank=HIGH_RANK, seed=4))
        perturb_B(eng.bank.live("hr"), seed=4)
        merged_in = _spy_merges(monkeypatch, eng.model)
        for merge in (False, True):
            lp, g = _run(eng, [TrainBatch("hr", data)], merge=merge)
            runs[dtype, merge] = (torch.cat(lp[0]), torch.cat([t.flatten() for t in g.values()]))
        assert len(set(merged_in)) == len(eng.bank.live("hr").layers)
        assert all(p.dtype == torch.float32 for p in eng.bank.live("hr").parameters())
    lp_ref, g_ref = runs["float32", False]

    def errors(key):
        lp, g = runs[key]
        return (lp - lp_ref).abs().max(), (g - g_ref).norm() / g_ref.norm()

    lp_err_plain, g_err_plain = errors(("bfloat16", False))
    lp_err_merged, g_err_merged = errors(("bfloat16", True))
    assert 0 < lp_err_plain < 0.05 and 0 < g_err_plain < 0.05  # bf16 is really in play
    assert lp_err_merged <= 1.5 * lp_err_plain
    assert g_err_merged <= 1.5 * g_err_plain


def test_merged_path_keeps_the_bias(monkeypatch):
    """Qwen2 projections carry a bias: the merged matmul must add it once, as the base does."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.eval()
    model.requires_grad_(False)
    biased = [n for n, m in model.named_modules() if getattr(m, "bias", None) is not None]
    with torch.no_grad():
        for name in biased:
            model.get_submodule(name).bias.normal_()
    bank = AdapterBank(model)
    bank.create("q", LoraSpec(rank=64, seed=2))
    perturb_B(bank.live("q"), seed=2)
    ids = torch.randint(0, 256, (2, 60), generator=torch.Generator().manual_seed(2))
    merged_in = _spy_merges(monkeypatch, model)
    outputs = {}
    for merge in (True, False):
        bank.merge_when_cheaper = merge
        with bank.rows(["q", "q"]):
            logits = model(input_ids=ids).logits  # (2, 60, 256)
        logits.log_softmax(-1)[..., 0].sum().backward()
        grads = [p.grad.clone() for p in bank.live("q").parameters()]
        outputs[merge] = logits.detach(), grads
        for p in bank.live("q").parameters():
            p.grad = None
    assert biased and set(biased) <= set(merged_in)
    torch.testing.assert_close(outputs[True][0], outputs[False][0], rtol=1e-5, atol=1e-5)
    for ours, ref in zip(outputs[True][1], outputs[False][1], strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))


def test_remove_hooks_restores_plain_linear(model_dir, plain_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    model.requires_grad_(False)
    bank = AdapterBank(model)
    bank.create("x", LoraSpec(rank=4, seed=1))
    perturb_B(bank.live("x"), seed=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator())
    with torch.no_grad():
        with bank.rows(["x", "x"]):
            adapted = model(input_ids=ids).logits
        bank.remove_hooks()
        assert all("forward" not in bank.modules[p].__dict__ for p in bank.live("x").layers)
        with bank.rows(["x", "x"]):
            detached = model(input_ids=ids).logits
        assert torch.equal(detached, plain_model(input_ids=ids).logits)
        assert not torch.allclose(adapted, detached, atol=1e-3)
