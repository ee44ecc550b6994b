"""The wire codec against the official tinker SDK's own encoders and decoders.

The SDK (tinker 0.38, with its own protobuf module) is the independent check: what it
writes we must read, and what we write it must read back to the same values.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")

import torch  # noqa: E402
from tinker import types as T  # noqa: E402
from tinker.proto import tinker_public_pb2 as tpb  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from treadle import types as t  # noqa: E402
from treadle.errors import InvalidRequestError  # noqa: E402
from treadle.wire import codec  # noqa: E402


def sdk_request(data, loss_fn="cross_entropy", config=None, seq_id=7) -> bytes:
    req = T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id="s:train:0",
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def test_decode_sdk_request_dense_and_config():
    rng = np.random.default_rng(0)
    adv = rng.normal(size=5).astype(np.float32)
    data = [
        T.Datum(
            model_input=T.ModelInput.from_ints([5, 6, 7, 8, 9]),
            loss_fn_inputs={
                "target_tokens": [6, 7, 8, 9, 10],
                "logprobs": [-1.0, -2.0, -0.5, -0.25, -3.0],
                "advantages": adv,
            },
        )
    ]
    body = sdk_request(data, "ppo", {"clip_low_threshold": 0.7, "note": "x"})
    model_id, seq_id, got, loss_fn, config, forward_only = codec.decode_forward_backward_request(
        body
    )
    assert (model_id, seq_id, loss_fn, forward_only) == ("s:train:0", 7, "ppo", False)
    assert config == {"clip_low_threshold": pytest.approx(0.7), "note": "x"}
    d = got[0]
    assert d.model_input.to_ints() == [5, 6, 7, 8, 9]
    assert d.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert d.loss_fn_inputs["target_tokens"].tolist() == [6, 7, 8, 9, 10]
    np.testing.assert_array_equal(d.loss_fn_inputs["advantages"].to_numpy(), adv)
    assert d.loss_fn_inputs["logprobs"].shape == [5]


def test_decode_sdk_request_sparse_csr():
    dense = torch.zeros((4, 6), dtype=torch.int64)
    dense[0, 1], dense[2, 5], dense[3, 0] = 11, 12, 13
    td = T.TensorData.from_torch_sparse(dense)
    assert td.sparse_crow_indices is not None  # the SDK really chose CSR
    data = [
        T.Datum(
            model_input=T.ModelInput.from_ints([1, 2, 3, 4]),
            loss_fn_inputs={"target_tokens": td, "weights": np.ones((4, 6), np.float32)},
        )
    ]
    _, _, got, *_ = codec.decode_forward_backward_request(sdk_request(data))
    tt = got[0].loss_fn_inputs["target_tokens"]
    assert tt.shape == [4, 6]
    np.testing.assert_array_equal(tt.to_numpy(), dense.numpy())


def test_legacy_config_map_is_read_and_v2_wins():
    msg = tpb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cispo")
    msg.loss_fn_config["clip_low_threshold"] = 0.5
    msg.loss_fn_config["clip_high_threshold"] = 1.5
    msg.loss_fn_config_v2["clip_high_threshold"].number = 1.25
    *_, config, _ = codec.decode_forward_backward_request(msg.SerializeToString())
    assert config == {"clip_low_threshold": 0.5, "clip_high_threshold": 1.25}


def test_int32_and_bf16_tensors_are_widened():
    msg = tpb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.array([3, 4], "<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].dense = np.array([4, 5], "<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].dtype = tpb.DTYPE_INT32
    w = np.array([0.5, 1.5], np.float32)
    d.loss_fn_inputs["weights"].dense = (w.view(np.uint32) >> 16).astype("<u2").tobytes()
    d.loss_fn_inputs["weights"].dtype = tpb.DTYPE_BFLOAT16
    _, _, got, *_ = codec.decode_forward_backward_request(msg.SerializeToString())
    assert got[0].loss_fn_inputs["target_tokens"].dtype == "int64"
    assert got[0].loss_fn_inputs["target_tokens"].tolist() == [4, 5]
    assert got[0].loss_fn_inputs["weights"].tolist() == [0.5, 1.5]


def test_our_request_encoding_matches_the_sdk_bytes():
    """Same message, field for field, as the SDK's encoder writes it."""
    ours = [
        t.Datum(
            model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1, 0, 1]}
        )
    ]
    sdk = [
        T.Datum(
            model_input=T.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 0.0, 1.0]},
        )
    ]
    config = {"beta": 0.1, "mode": "x"}
    a = tpb.ForwardBackwardRequest.FromString(
        codec.encode_forward_backward_request("s:train:0", 7, ours, "dro", config, False)
    )
    b = tpb.ForwardBackwardRequest.FromString(sdk_request(sdk, "dro", config))
    assert a == b


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda b: b"\xff\xff\xff" + b, "not a valid protobuf"),
        (lambda b: b[:-3], "not a valid protobuf"),
    ],
)
def test_malformed_bodies_name_the_problem(mutate, needle):
    body = sdk_request([T.Datum(model_input=T.ModelInput.from_ints([1]), loss_fn_inputs={})])
    with pytest.raises(InvalidRequestError, match=needle):
        codec.decode_forward_backward_request(mutate(body))


def test_bad_tensor_bytes_and_shapes_are_rejected():
    msg = tpb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(3, dtype="<i4").tobytes()
    d.loss_fn_inputs["weights"].dense = b"\x00" * 6  # not a multiple of 4
    d.loss_fn_inputs["weights"].dtype = tpb.DTYPE_FLOAT32
    with pytest.raises(InvalidRequestError, match=r"weights.*multiple"):
        codec.decode_forward_backward_request(msg.SerializeToString())
    d.loss_fn_inputs["weights"].dense = b"\x00" * 8
    d.loss_fn_inputs["weights"].shape.extend([3])
    with pytest.raises(InvalidRequestError, match=r"shape \[3\] needs 3 values, got 2"):
        codec.decode_forward_backward_request(msg.SerializeToString())
    d.loss_fn_inputs["weights"].shape[:] = [4]  # sizes are checked before anything is read
    with pytest.raises(InvalidRequestError, match=r"expected leading length 3"):
        codec.decode_forward_backward_request(msg.SerializeToString())


def test_forward_backward_output_read_by_the_sdk():
    rng = np.random.default_rng(1)
    lp_a = rng.normal(size=3).astype(np.float32)
    lp_b = rng.normal(size=5).astype(np.float32)
    lp_c = rng.normal(size=(2, 4)).astype(np.float32)  # a (T, K) output starts a new record
    out = t.ForwardBackwardOutput(
        loss_fn_outputs=[
            {"logprobs": t.TensorData.from_numpy(lp_a)},
            {"logprobs": t.TensorData.from_numpy(lp_b)},
            {"logprobs": t.TensorData.from_numpy(lp_c)},
        ],
        metrics={"loss:sum": 1.5, "n:sum": 3.0},
    )
    body = codec.encode_forward_backward_output(out)
    msg = tpb.ForwardBackwardOutput.FromString(body)
    assert [r.num_datums for r in msg.loss_fn_outputs] == [2, 1]
    offsets = np.frombuffer(msg.loss_fn_outputs[0].fields["logprobs"].offsets, np.int64)
    assert offsets.tolist() == [0, 12, 32]  # byte offsets
    sdk = deserialize_forward_backward_output(body)
    assert sdk.metrics == {"loss:sum": 1.5, "n:sum": 3.0}
    for got, want in zip(sdk.loss_fn_outputs, [lp_a, lp_b, lp_c], strict=True):
        np.testing.assert_array_equal(got["logprobs"].to_numpy(), want)
    back = codec.decode_forward_backward_output(body)
    assert back.metrics == out.metrics
    np.testing.assert_array_equal(back.loss_fn_outputs[2]["logprobs"].to_numpy(), lp_c)


def test_forward_backward_output_from_sdk_bytes_int32_bf16():
    msg = tpb.ForwardBackwardOutput(loss_fn_output_type="x:ArrayRecord")
    rec = msg.loss_fn_outputs.add(num_datums=2)
    ids = rec.fields["ids"]
    ids.data, ids.dtype = np.array([1, 2, 3], "<i4").tobytes(), tpb.DTYPE_INT32
    ids.offsets = np.array([0, 8, 12], "<i8").tobytes()
    vals = np.array([0.5, -2.0, 4.0], np.float32)
    lp = rec.fields["lp"]
    lp.data = (vals.view(np.uint32) >> 16).astype("<u2").tobytes()
    lp.dtype, lp.offsets = tpb.DTYPE_BFLOAT16, np.array([0, 4, 6], "<i8").tobytes()
    out = codec.decode_forward_backward_output(msg.SerializeToString())
    assert out.loss_fn_output_type == "ArrayRecord"
    assert [o["ids"].tolist() for o in out.loss_fn_outputs] == [[1, 2], [3]]
    assert [o["lp"].tolist() for o in out.loss_fn_outputs] == [[0.5, -2.0], [4.0]]


def test_sample_response_read_by_the_sdk():
    resp = t.SampleResponse(
        sequences=[
            t.SampledSequence(stop_reason="length", tokens=[5, 6, 7], logprobs=[-0.5, -1.0, -2.0]),
            t.SampledSequence(stop_reason="stop", tokens=[9], logprobs=None),
        ],
        prompt_logprobs=[None, -1.25, -3.5],
        topk_prompt_logprobs=[None, [(3, -0.5), (4, -1.5)], [(8, -0.75)]],
    )
    body = codec.encode_sample_response(resp)
    sdk = deserialize_sample_response(body)
    assert [s.stop_reason for s in sdk.sequences] == ["length", "stop"]
    assert sdk.sequences[0].tokens == [5, 6, 7]
    assert sdk.sequences[0].logprobs == [-0.5, -1.0, -2.0]
    assert sdk.sequences[1].logprobs is None
    assert sdk.prompt_logprobs == [None, -1.25, -3.5]
    assert sdk.topk_prompt_logprobs == [None, [(3, -0.5), (4, -1.5)], [(8, -0.75)]]
    back = codec.decode_sample_response(body)
    assert back.prompt_logprobs == resp.prompt_logprobs
    assert back.topk_prompt_logprobs == resp.topk_prompt_logprobs
    assert back.sequences[0].tokens == [5, 6, 7] and back.sequences[1].logprobs is None


def test_sample_response_from_sdk_bytes_with_nan_and_empty_cells():
    msg = tpb.SampleResponse()
    s = msg.sequences.add(stop_reason=tpb.STOP_REASON_STOP)
    s.tokens = np.array([1, 2], "<i4").tobytes()
    msg.prompt_logprobs = np.array([math.nan, -0.5], "<f4").tobytes()
    msg.topk_prompt_logprobs.token_ids = np.array([[0, 0], [7, 0]], "<i4").tobytes()
    msg.topk_prompt_logprobs.logprobs = np.array(
        [[-99999.0, -99999.0], [-0.25, -99999.0]], "<f4"
    ).tobytes()
    msg.topk_prompt_logprobs.k, msg.topk_prompt_logprobs.length = 2, 2
    out = codec.decode_sample_response(msg.SerializeToString())
    assert out.prompt_logprobs == [None, -0.5]
    assert out.topk_prompt_logprobs == [None, [(7, -0.25)]]
    assert out.sequences[0].stop_reason == "stop" and out.sequences[0].logprobs is None
