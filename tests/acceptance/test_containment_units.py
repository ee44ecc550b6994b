"""Units of containment, without a server: the rules for ops parked behind a missing seq_id,
the sizes checked before anything is allocated, the bounds of request fields, and the
start-up sweep of interrupted writes.

    .venv/bin/python -m pytest -q tests/acceptance/test_containment_units.py
"""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from treadle.artifacts import folders as artifacts
from treadle.engine.types import TrainDatum
from treadle.errors import InvalidRequestError
from treadle.protocol.ops import Op, OpKind, TrainData
from treadle.server.core import validation
from treadle.wire import requests as rq
from treadle.worker.scheduler import (
    ModelQueue,
    ParkLimits,
    enqueue,
    expire_parked,
    op_bytes,
    plan_round,
)


def train_op(seq: int, tokens: int = 4, at: float = 0.0) -> Op:
    datum = TrainDatum(np.zeros(tokens, np.int64), {"weights": np.ones(tokens, np.float32)})
    op = Op(f"r{seq}", OpKind.FORWARD, TrainData([datum], "cross_entropy", {}), "m", seq)
    op.enqueued_at = at
    return op


# ---- ops parked behind a gap ----------------------------------------------------------------
def test_ops_in_order_are_never_parked():
    q, limits = ModelQueue(next_seq=1), ParkLimits(max_ops=1, max_bytes=1)
    for seq in (1, 2, 3):  # each fills the gap the one before it left: nothing is parked
        assert enqueue(q, train_op(seq, tokens=100), limits) is None
    assert sorted(q.pending) == [1, 2, 3]


def test_parked_ops_are_bounded_in_count_and_a_stand_in_holds_the_place():
    q, limits = ModelQueue(next_seq=1), ParkLimits(max_ops=2, max_bytes=1 << 20)
    assert enqueue(q, train_op(3), limits) is None
    assert enqueue(q, train_op(4), limits) is None
    error = enqueue(q, train_op(5), limits)
    assert isinstance(error, InvalidRequestError)
    assert "max_parked_ops 2" in str(error) and "seq_id 1" in str(error)
    # the refused op's place holds its failure, so that 6 need not wait for it
    assert q.pending[5].kind == OpKind.SKIP and q.pending[5].request_id == "r5"
    assert enqueue(q, train_op(1), limits) is None and enqueue(q, train_op(2), limits) is None
    steps = plan_round({"m": q}, [], 8)
    assert [op.seq_id for op in steps[0].ops] == [1, 2, 3, 4]


def test_parked_ops_are_bounded_in_bytes():
    big = train_op(3, tokens=1000)
    q, limits = ModelQueue(next_seq=1), ParkLimits(max_ops=10, max_bytes=op_bytes(big) + 100)
    assert enqueue(q, big, limits) is None
    error = enqueue(q, train_op(4, tokens=1000), limits)
    assert error is not None and "max_parked_bytes" in str(error)
    assert enqueue(q, train_op(5, tokens=2), limits) is None  # a small one still fits


def test_stand_ins_are_bounded_too():
    q, limits = ModelQueue(next_seq=1), ParkLimits(max_ops=1, max_bytes=1 << 20)
    assert enqueue(q, train_op(2), limits) is None
    assert enqueue(q, train_op(3), limits) is not None  # refused, a stand-in takes 3
    assert enqueue(q, train_op(4), limits) is not None  # refused, no room for a stand-in
    assert 3 in q.pending and 4 not in q.pending


def test_a_stalled_model_gives_up_its_missing_seq_id_at_the_deadline():
    q, limits = ModelQueue(next_seq=1), ParkLimits(max_ops=1, timeout_s=10.0)
    enqueue(q, train_op(2, at=0.0), limits)
    enqueue(q, train_op(3, at=5.0), limits)  # refused: a stand-in
    assert expire_parked("m", q, now=9.0, timeout_s=10.0) == []
    failed = expire_parked("m", q, now=10.0, timeout_s=10.0)
    assert [o.request_id for o in failed] == ["r2"]  # the stand-in's request failed already
    assert (
        "seq_id 1" in failed[0].error.message and "parked_op_timeout_s" in failed[0].error.message
    )
    assert q.next_seq == 4 and not q.pending
    late = enqueue(q, train_op(1), limits)
    assert late is not None and "given up" in str(late)
    assert enqueue(q, train_op(4), limits) is None


def test_ops_that_can_run_never_time_out():
    q = ModelQueue(next_seq=1)
    enqueue(q, train_op(1, at=0.0), ParkLimits())
    enqueue(q, train_op(3, at=0.0), ParkLimits())  # parked behind 2, but the model runs
    assert expire_parked("m", q, now=1e9, timeout_s=10.0) == []


# ---- sizes before allocation ---------------------------------------------------------------
def test_a_target_table_is_counted_before_it_exists():
    sparse = {"dtype": "int64", "shape": [4, 1000], "data": [], "sparse_crow_indices": [0] * 5,
              "sparse_col_indices": []}  # fmt: skip
    with pytest.raises(InvalidRequestError, match="max_request_cells 1000"):
        validation.target_prompt_ids(sparse, 5, 100, max_cells=1000)
    assert validation.target_prompt_ids({**sparse, "shape": [4, 10]}, 5, 100).shape == (4, 10)
    for bad in ({**sparse, "data": [2**70], "sparse_col_indices": [0],
                 "sparse_crow_indices": [0, 1, 1, 1, 1]},
                {**sparse, "shape": [4, 2.5]},
                {**sparse, "sparse_crow_indices": 7}):  # fmt: skip
        with pytest.raises(InvalidRequestError, match="target_prompt_logprobs"):
            validation.target_prompt_ids(bad, 5, 100)


# ---- request fields -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model, body, field",
    [
        (rq.OptimStepRequest, {"model_id": "m", "seq_id": 2**63}, "seq_id"),
        (rq.OptimStepRequest, {"model_id": "m", "seq_id": -1}, "seq_id"),
        (rq.CreateModelRequest, {"session_id": "s", "model_seq_id": 2**64, "base_model": "b"},
         "model_seq_id"),
        (rq.CreateSessionRequest, {"user_metadata": {"a": 1}}, "user_metadata"),
        (rq.CreateSessionRequest, {"user_metadata": {str(i): "" for i in range(65)}},
         "user_metadata"),
        (rq.CreateSessionRequest, {"tags": ["x"] * 65}, "tags"),
        (rq.SaveWeightsRequest, {"model_id": "m", "ttl_seconds": 2**63}, "ttl_seconds"),
    ],
)  # fmt: skip
def test_request_fields_are_bounded(model, body, field):
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    assert e.value.errors()[0]["loc"][0] == field


def test_the_sdks_values_pass():
    seq = 10**18 + 5  # a cloned sampling client's block, as both SDKs number them
    assert (
        rq.SampleRequest.model_validate(
            {"seq_id": seq, "prompt": {"chunks": []}, "sampling_params": {}}
        ).seq_id
        == seq
    )
    meta = {"training_session_name": "x" * 200}
    assert rq.CreateSessionRequest(user_metadata=meta).user_metadata == meta


# ---- start-up sweep -------------------------------------------------------------------------
def test_the_start_up_sweep_removes_leftovers_and_restores_a_moved_checkpoint(tmp_path):
    root, cache = tmp_path / "artifacts", tmp_path / "cache"
    done = root / "run" / "weights" / "done"
    for folder in (done, root / "run" / "weights" / ".tmp-done-0badf00d",
                   root / "run" / "weights" / ".old-done-0badf00d",
                   root / "run" / "sampler_weights" / ".old-gone-0badf00d",
                   root / ".refresh" / "x", cache / "y"):  # fmt: skip
        folder.mkdir(parents=True)
    removed = artifacts.remove_leftovers([root, tmp_path / "missing"], [cache])
    assert sorted(p.name for p in removed) == [
        ".old-done-0badf00d",
        ".refresh",
        ".tmp-done-0badf00d",
        "cache",
    ]
    assert done.is_dir() and (root / "run" / "sampler_weights" / "gone").is_dir()
    assert not cache.exists()
