"""AdapterBank: fresh adapters equal the base, rows route to their own adapter, snapshots."""

from __future__ import annotations

import math

import pytest
import torch

from treadle.engine.types import LoraSpec
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
