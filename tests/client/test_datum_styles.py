"""A datum built from Python lists and one built from numpy arrays are the same request.

Users build datums both ways (the published loop uses lists: `ModelInput.from_ints(toks)`,
`"weights": [1.0] * n`). Through either SDK, both must encode to the same protobuf body and
reach the engine as the same arrays with the same dtypes; through a real server, both must
give the same logprobs.
"""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")

from tinker import types as T  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

import treadle  # noqa: E402
from treadle.protocol.facts import EngineFacts  # noqa: E402
from treadle.server.core import validation  # noqa: E402
from treadle.wire import codec  # noqa: E402
from treadle.wire import tinker_pb2 as pb  # noqa: E402

TINY = "treadle/tiny-llama"  # the name tests/conftest.py serves the tiny model under
API_KEY = "tml-test"
VOCAB = 256
rng = np.random.default_rng(0)
ROWS_B_T = rng.integers(3, VOCAB, (3, 17))  # (B, T+1)
LOGPROBS_B_T = -rng.random((3, 16)).astype(np.float32)  # (B, T)
ADVANTAGES_B = rng.normal(size=3)


def lists_of(loss_fn: str) -> list[tuple[list[int], dict]]:
    """(tokens, loss_fn_inputs) of each row, as Python lists."""
    out = []
    for row, lp, adv in zip(ROWS_B_T.tolist(), LOGPROBS_B_T.tolist(), ADVANTAGES_B, strict=True):
        n = len(row) - 1
        if loss_fn == "cross_entropy":  # int weights, as a user may write them: both SDKs
            # type a list by its key (float32 here), not by its items
            inputs = {"target_tokens": row[1:], "weights": [1] * (n - 2) + [0, 1]}
        else:
            inputs = {"target_tokens": row[1:], "logprobs": lp, "advantages": [float(adv)] * n}
        out.append((row[:-1], inputs))
    return out


def arrays_of(loss_fn: str) -> list[tuple[list[int], dict]]:
    """The same rows as numpy arrays, in the dtypes numpy gives by default."""
    out = []
    for row, lp, adv in zip(ROWS_B_T, LOGPROBS_B_T, ADVANTAGES_B, strict=True):
        n = len(row) - 1
        if loss_fn == "cross_entropy":
            w = np.ones(n, np.float32)
            w[-2] = 0.0
            inputs = {"target_tokens": row[1:], "weights": w}
        else:  # float64 advantages, as np.full makes them
            inputs = {"target_tokens": row[1:], "logprobs": lp, "advantages": np.full(n, adv)}
        out.append((row[:-1].tolist(), inputs))
    return out


def datums(sdk: str, rows: list[tuple[list[int], dict]]) -> list:
    M = T if sdk == "tinker" else treadle
    return [
        M.Datum(model_input=M.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)
        for tokens, inputs in rows
    ]


def body(sdk: str, data: list, loss_fn: str) -> bytes:
    if sdk == "treadle":
        return codec.encode_forward_backward_request("m", 1, data, loss_fn, {}, False)
    request = T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(data=data, loss_fn=loss_fn),
        model_id="m",
        seq_id=1,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_lists_and_arrays_encode_to_the_same_bytes_in_both_sdks(loss_fn):
    bodies = {
        (sdk, style): body(sdk, datums(sdk, make(loss_fn)), loss_fn)
        for sdk in ("tinker", "treadle")
        for style, make in (("lists", lists_of), ("arrays", arrays_of))
    }
    reference = bodies[("tinker", "arrays")]
    assert {k: v == reference for k, v in bodies.items()} == {k: True for k in bodies}


def expected_inputs(loss_fn: str) -> list[dict[str, np.ndarray]]:
    """Each row's loss inputs as the wire must carry them, from the numbers themselves:
    target_tokens int64, every other key float32."""
    out = []
    for row, lp, adv in zip(ROWS_B_T, LOGPROBS_B_T, ADVANTAGES_B, strict=True):
        n = len(row) - 1
        if loss_fn == "cross_entropy":
            w = np.ones(n, np.float32)
            w[-2] = 0.0
            out.append({"target_tokens": row[1:].astype(np.int64), "weights": w})
        else:
            advantages = np.full(n, adv, np.float32)
            out.append(
                {
                    "target_tokens": row[1:].astype(np.int64),
                    "logprobs": lp,
                    "advantages": advantages,
                }
            )
    return out


@pytest.mark.parametrize("sdk", ["tinker", "treadle"])
@pytest.mark.parametrize("style", ["lists", "arrays"])
@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_each_body_carries_the_numbers_in_the_wire_dtypes(sdk, style, loss_fn):
    """Read with the bare protobuf classes, not our codec: a change every SDK and style
    made alike (a float64 tensor, an int64 weight, tokens not int32) fails here too."""
    make = lists_of if style == "lists" else arrays_of
    msg = pb.ForwardBackwardRequest.FromString(body(sdk, datums(sdk, make(loss_fn)), loss_fn))
    assert (msg.model_id, msg.seq_id, msg.loss_fn, msg.forward_only) == ("m", 1, loss_fn, False)
    assert len(msg.data) == len(ROWS_B_T)
    wire = {np.dtype(np.int64): pb.DTYPE_INT64, np.dtype(np.float32): pb.DTYPE_FLOAT32}
    for datum, row, want in zip(msg.data, ROWS_B_T, expected_inputs(loss_fn), strict=True):
        assert [c.WhichOneof("chunk") for c in datum.model_input] == ["encoded_text"]
        assert datum.model_input[0].encoded_text.tokens == row[:-1].astype("<i4").tobytes()
        assert set(datum.loss_fn_inputs) == set(want)
        for key, array in want.items():
            tensor = datum.loss_fn_inputs[key]
            assert tensor.WhichOneof("encoding") == "dense", key
            assert tensor.dtype == wire[array.dtype], key
            assert list(tensor.shape) == [len(array)], key
            assert tensor.dense == array.astype(array.dtype.newbyteorder("<")).tobytes(), key


@pytest.mark.parametrize("sdk", ["tinker", "treadle"])
@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_lists_and_arrays_reach_the_engine_as_the_same_arrays(sdk, loss_fn):
    facts = EngineFacts("m", VOCAB, 1024, 8)
    got = {}
    for style, make in (("lists", lists_of), ("arrays", arrays_of)):
        msg = codec.parse_forward_backward_request(body(sdk, datums(sdk, make(loss_fn)), loss_fn))
        got[style] = validation.train_data(codec.forward_backward_arrays(msg, 1 << 20), facts)
    pairs = zip(got["lists"].data, got["arrays"].data, strict=True)
    for (a, b), row, lp in zip(pairs, ROWS_B_T, LOGPROBS_B_T, strict=True):
        assert a.tokens.dtype == b.tokens.dtype == np.int64
        np.testing.assert_array_equal(a.tokens, row[:-1])
        np.testing.assert_array_equal(b.tokens, row[:-1])
        assert a.loss_inputs.keys() == b.loss_inputs.keys()
        for key in a.loss_inputs:
            want = np.int64 if key == "target_tokens" else np.float32
            assert a.loss_inputs[key].dtype == b.loss_inputs[key].dtype == want, key
            np.testing.assert_array_equal(a.loss_inputs[key], b.loss_inputs[key])
        np.testing.assert_array_equal(a.loss_inputs["target_tokens"], row[1:])
        if loss_fn == "ppo":
            np.testing.assert_array_equal(a.loss_inputs["logprobs"], lp)


def test_lists_and_arrays_give_the_same_logprobs_through_a_server(server_url):
    """One adapter, a forward of each style through each SDK: the same numbers exactly."""
    got = {}
    svc = tinker.ServiceClient(base_url=server_url, api_key=API_KEY)
    tc = svc.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
    ours = treadle.ServiceClient(base_url=server_url, api_key=API_KEY)
    tc_ours = ours.create_lora_training_client(TINY, rank=4, seed=3)
    for style, make in (("lists", lists_of), ("arrays", arrays_of)):
        out = tc.forward(datums("tinker", make("cross_entropy")), "cross_entropy").result()
        got[("tinker", style)] = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
        out = tc_ours.forward(datums("treadle", make("cross_entropy")), "cross_entropy").result()
        got[("treadle", style)] = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
    svc.close("success")
    ours.close()
    for key, rows in got.items():
        assert len(rows) == len(ROWS_B_T), key
        for row, ref in zip(rows, got[("tinker", "arrays")], strict=True):
            assert row.dtype == np.float32 and row.shape == (16,), key
            np.testing.assert_array_equal(row, ref, err_msg=str(key))
