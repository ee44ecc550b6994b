"""The SDK's own logic (ordering, chunking, retries, long-polls, errors, custom losses)
against a protocol-level stand-in server that logs what arrives and when.

    .venv/bin/python -m pytest -q tests/client/test_sdk_logic.py
"""

from __future__ import annotations

import asyncio
import pickle
import time

import numpy as np
import pytest
from _fake_server import FakeServer, fake_logprobs
from _proxy import FaultProxy

from treadle import AdamParams, Datum, ModelInput, ServiceClient
from treadle.client.chunks import combine_outputs, split_chunks
from treadle.client.errors import BadRequestError, RequestFailedError, status_error
from treadle.client.transport import RetryPolicy
from treadle.errors import InvalidRequestError
from treadle.types import ForwardBackwardOutput, TensorData

torch = pytest.importorskip("torch")

FAST_RETRY = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.05, deadline_s=5)


def datum(seed: int, n: int = 5) -> Datum:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50, n + 1)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1].tolist()),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": rng.random(n).astype(np.float32)},
    )


def expected_loss(data: list[Datum]) -> float:
    """The stand-in's cross-entropy, from its logprob formula."""
    return sum(
        float(
            -(
                fake_logprobs(d.loss_fn_inputs["target_tokens"].to_numpy())
                * d.loss_fn_inputs["weights"].to_numpy()
            ).sum()
        )
        for d in data
    )


@pytest.fixture
def fake():
    with FakeServer() as server:
        yield server


def client(url: str) -> ServiceClient:
    return ServiceClient(base_url=url, api_key="tml-test", retry=FAST_RETRY)


def train_arrivals(fake: FakeServer) -> list[tuple[str, int]]:
    return [(p, s) for p, s, _ in fake.state.arrivals if p in ("forward_backward", "optim_step")]


def test_training_ops_are_sent_in_order_before_any_wait(fake):
    fake.state.exec_delay_s = 0.2
    with client(fake.url) as svc:
        tc = svc.create_lora_training_client("fake/model")
        d1, d2 = [datum(1), datum(2)], [datum(3)]
        done_at: dict[str, float] = {}
        fb1 = tc.forward_backward(d1)
        fb1.add_done_callback(lambda _: done_at.setdefault("fb1", time.monotonic()))
        op1 = tc.optim_step(AdamParams(learning_rate=1e-3))
        fb2 = tc.forward_backward(d2)
        op2 = tc.optim_step(AdamParams(learning_rate=1e-3))
        out1, out2 = fb1.result(10), fb2.result(10)
        op1.result(10), op2.result(10)
    assert train_arrivals(fake) == [
        ("forward_backward", 1),
        ("optim_step", 2),
        ("forward_backward", 3),
        ("optim_step", 4),
    ]
    optim_arrived = next(t for p, s, t in fake.state.arrivals if p == "optim_step")
    assert optim_arrived < done_at["fb1"], "optim_step must be on the server before fb completes"
    assert out1.metrics["loss:sum"] == pytest.approx(expected_loss(d1), rel=1e-6)
    assert out2.metrics["loss:sum"] == pytest.approx(expected_loss(d2), rel=1e-6)
    for d, row in zip(d1, out1.loss_fn_outputs, strict=True):
        want = fake_logprobs(d.loss_fn_inputs["target_tokens"].to_numpy())
        np.testing.assert_allclose(row["logprobs"].to_numpy(), want)


def test_big_batch_is_chunked_with_first_chunk_last(fake):
    fake.state.client_config = {"fwdbwd_max_chunk_len": 2}
    data = [datum(i) for i in range(5)]
    with client(fake.url) as svc:
        tc = svc.create_lora_training_client("fake/model")
        out = tc.forward_backward(data).result(10)
    seqs = [s for p, s in train_arrivals(fake)]
    assert sorted(seqs) == [1, 2, 3] and seqs[-1] == 1
    assert len(out.loss_fn_outputs) == 5
    for d, row in zip(data, out.loss_fn_outputs, strict=True):
        want = fake_logprobs(d.loss_fn_inputs["target_tokens"].to_numpy())
        np.testing.assert_allclose(row["logprobs"].to_numpy(), want)
    assert out.metrics["loss:sum"] == pytest.approx(expected_loss(data), rel=1e-6)
    # seq:mean is each chunk's seq_id, averaged by datum count: (2*1 + 2*2 + 1*3) / 5
    assert out.metrics["seq:mean"] == pytest.approx(1.8)


def test_transient_503_is_retried_and_executed_once(fake):
    fake.state.fail_next["forward_backward"] = 2
    with client(fake.url) as svc:
        tc = svc.create_lora_training_client("fake/model")
        out = tc.forward_backward([datum(0)]).result(10)
        tc.optim_step().result(10)
    assert [s for p, s in train_arrivals(fake) if p == "forward_backward"] == [1, 1, 1]
    assert fake.state.executed.count(("sess:train:0", 1)) == 1
    assert out.metrics["loss:sum"] == pytest.approx(expected_loss([datum(0)]), rel=1e-6)


def test_connection_reset_after_execution_is_not_executed_twice(fake):
    with FaultProxy(fake.port) as proxy, client(proxy.url) as svc:
        tc = svc.create_lora_training_client("fake/model")
        proxy.add_rule("/api/v1/forward_backward", "reset_after")
        proxy.add_rule("/api/v1/optim_step", "reset_before")
        fb = tc.forward_backward([datum(0)])
        op = tc.optim_step()
        fb.result(10), op.result(10)
        assert proxy.fired("/api/v1/forward_backward") == ["reset_after", "forward"]
        assert proxy.fired("/api/v1/optim_step") == ["reset_before", "forward"]
    assert fake.state.executed == [("sess:train:0", 1), ("sess:train:0", 2)]


def test_all_samples_are_in_flight_before_the_first_wait(fake):
    # The stand-in answers no sample until all 16 have arrived: a client that waited on one
    # before sending the next would time out here.
    fake.state.sample_barrier = 16
    with client(fake.url) as svc:
        sc = svc.create_sampling_client(base_model="fake/model")
        futs = [sc.sample([i, i + 1], num_samples=2) for i in range(16)]
        results = [f.result(10) for f in futs]
    for i, r in enumerate(results):
        assert [s.tokens for s in r.sequences] == [[i + 1, 0], [i + 1, 1]]
        assert all(s.sequence_id for s in r.sequences)
    assert sorted(s for p, s, _ in fake.state.arrivals if p == "asample") == list(range(16))


def test_a_pickled_sampling_client_samples_under_its_own_seq_ids(fake):
    from treadle.client.sampling import CLONE_BLOCK

    with client(fake.url) as svc:
        sc = svc.create_sampling_client(base_model="fake/model")
        sc.sample([1, 2]).result(10)
        copy = pickle.loads(pickle.dumps(sc))
        assert copy.sampling_session_id == sc.sampling_session_id
        assert [s.tokens for s in copy.sample([5, 6], 2).result(10).sequences] == [[6, 0], [6, 1]]
    seqs = [s for p, s, _ in fake.state.arrivals if p == "asample"]
    assert seqs[0] == 0 and seqs[1] >= CLONE_BLOCK and seqs[1] % CLONE_BLOCK == 0


def test_errors_are_typed_and_the_client_keeps_working(fake):
    with client(fake.url) as svc:
        tc = svc.create_lora_training_client("fake/model")
        with pytest.raises(BadRequestError) as bad:
            tc.save_state("bad").result(10)
        assert bad.value.status_code == 400 and bad.value.message == "path: 'bad' is not allowed"
        assert isinstance(bad.value, InvalidRequestError)
        with pytest.raises(RequestFailedError) as failed:
            tc.save_state("ok").result(10)
        assert failed.value.message == "disk full" and failed.value.category == "server"
        with pytest.raises(TypeError):  # cannot be encoded: raised at once, no seq_id spent
            tc.forward([datum(0)], loss_fn_config={"clip": [1, 2]})
        out = tc.forward([datum(0)]).result(10)
    assert out.metrics["loss:sum"] == pytest.approx(expected_loss([datum(0)]), rel=1e-6)
    assert [s for p, s in train_arrivals(fake)] == [3]  # after save_state's 1 and 2


def test_futures_can_be_awaited_from_asyncio(fake):
    with client(fake.url) as svc:
        tc = svc.create_lora_training_client("fake/model")

        async def main() -> ForwardBackwardOutput:
            return await tc.forward([datum(0)])

        out = asyncio.run(main())
    assert out.metrics["loss:sum"] == pytest.approx(expected_loss([datum(0)]), rel=1e-6)


def test_custom_loss_sends_minus_gradient_as_weights(fake):
    data = [datum(1), datum(2, n=3)]
    with client(fake.url) as svc:
        tc = svc.create_lora_training_client("fake/model")

        def loss_fn(data, logprobs):
            loss = sum((lp**2 * (i + 1)).sum() for i, lp in enumerate(logprobs))
            return loss, {"custom:mean": 7.0}

        fut = tc.forward_backward_custom(data, loss_fn)
        op = tc.optim_step()
        out = fut.result(10)
        op.result(10)
    assert train_arrivals(fake) == [
        ("forward_backward", 1),
        ("forward_backward", 2),
        ("optim_step", 3),
    ]
    backward = next(e for e in fake.state.requests.values() if e["key"] == ("sess:train:0", 2))
    lps = [fake_logprobs(d.loss_fn_inputs["target_tokens"].to_numpy()) for d in data]
    for i, (sent, lp) in enumerate(zip(backward["weights"], lps, strict=True)):
        # L = sum_i (i+1) * lp_i^2 → weights = -dL/dlp = -2 (i+1) lp
        np.testing.assert_allclose(
            sent.loss_fn_inputs["weights"].to_numpy(), -2 * (i + 1) * lp, rtol=1e-6
        )
    want_loss = sum(float((lp**2 * (i + 1)).sum()) for i, lp in enumerate(lps))
    assert out.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5)
    assert out.metrics["custom:mean"] == 7.0
    assert "surrogate_loss:sum" in out.metrics


def test_custom_loss_that_raises_still_fills_its_seq_id(fake):
    with client(fake.url) as svc:
        tc = svc.create_lora_training_client("fake/model")

        def broken(data, logprobs):
            raise ZeroDivisionError("user bug")

        fut = tc.forward_backward_custom([datum(0)], broken)
        op = tc.optim_step()
        with pytest.raises(ZeroDivisionError):
            fut.result(10)
        op.result(10)  # would hang if seq_id 2 were never sent
    assert [s for _, s in fake.state.executed] == [1, 2, 3]


def test_session_heartbeats_until_the_last_training_client_stops(fake, monkeypatch):
    from treadle.client import session

    monkeypatch.setattr(session, "HEARTBEAT_S", 0.05)
    svc = client(fake.url)
    tc1 = svc.create_lora_training_client("fake/model")
    tc2 = svc.create_lora_training_client("fake/model")
    assert (tc1.model_id, tc2.model_id) == ("sess:train:0", "sess:train:1")
    time.sleep(0.5)
    tc1.stop()
    assert [p for p, _, _ in fake.state.arrivals].count("finish") == 0  # tc2 still open
    with tc2:
        tc2.forward([datum(0)]).result(10)
    beats = [p for p, _, _ in fake.state.arrivals].count("session_heartbeat")
    assert beats >= 3
    assert [p for p, _, _ in fake.state.arrivals].count("finish") == 1
    time.sleep(0.3)
    assert [p for p, _, _ in fake.state.arrivals].count("session_heartbeat") == beats
    svc.close()


def test_unreachable_server_fails_fast_with_a_connection_error():
    from _fake_server import free_port

    from treadle.client.errors import APIConnectionError

    t0 = time.monotonic()
    with pytest.raises(APIConnectionError) as err:
        client(f"http://127.0.0.1:{free_port()}")
    assert isinstance(err.value, ConnectionError)
    assert time.monotonic() - t0 < FAST_RETRY.deadline_s + 2


def test_a_transport_never_closed_is_released_when_collected_and_at_exit(fake):
    import gc
    import subprocess
    import sys

    from treadle.client.transport import Transport

    transport = Transport(fake.url, None)
    assert transport.call(transport.post("/api/v1/client/config", {})) is not None
    thread = transport._thread
    del transport
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()  # its loop stopped, its pool closed
    # left open until the interpreter exits: closed then, with nothing reported
    script = (
        "from treadle.client.transport import Transport\n"
        f"t = Transport({fake.url!r}, None)\n"
        "print(type(t.call(t.post('/api/v1/client/config', {}))).__name__)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "dict", run.stderr
    assert "Unclosed" not in run.stderr, run.stderr


def test_tokenizer_without_transformers_encodes_alike(tiny_model_dir):
    from treadle.client.tokenizer import RawTokenizer, load_from_dir

    hf = load_from_dir(tiny_model_dir)
    raw = load_from_dir(tiny_model_dir, use_transformers=False)
    assert isinstance(raw, RawTokenizer) and len(raw) == len(hf)
    for text in ["12+34=46", "What is 7*8? 56", "<|im_end|>"]:
        ids = raw.encode(text)
        assert ids == hf.encode(text)
        assert raw.decode(ids) == hf.decode(ids)


# ---- pure helpers ----------------------------------------------------------------------------


def test_split_chunks_respects_length_and_bytes():
    data = [datum(i, n=10) for i in range(7)]  # 10 tokens*4 + 10*8 + 10*4 = 160 bytes each
    assert [len(c) for c in split_chunks(data, max_len=3)] == [3, 3, 1]
    assert [len(c) for c in split_chunks(data, max_bytes=330)] == [2, 2, 2, 1]
    assert [len(c) for c in split_chunks(data[:1], max_bytes=1)] == [1]


def test_combine_outputs_reduces_each_metric_by_its_suffix():
    def out(n: int, metrics: dict) -> ForwardBackwardOutput:
        rows = [{"logprobs": TensorData.from_numpy(np.zeros(1, np.float32))}] * n
        return ForwardBackwardOutput(loss_fn_outputs=rows, metrics=metrics)

    parts = [
        out(1, {"a:sum": 1, "b:mean": 2, "c:min": 3, "d:max": 3, "e:slack": 1, "u:unique": 5}),
        out(3, {"a:sum": 2, "b:mean": 6, "c:min": 1, "d:max": 9, "e:slack": 5, "u:unique": 6}),
    ]
    m = combine_outputs(parts).metrics
    assert m["a:sum"] == 3 and m["c:min"] == 1 and m["d:max"] == 9
    assert m["b:mean"] == pytest.approx((2 + 3 * 6) / 4)
    assert m["e:slack"] == pytest.approx(5 - (1 + 3 * 5) / 4)
    assert m["u:unique"] == 5 and m["u:unique_1"] == 6


def test_status_errors_are_typed_and_picklable():
    err = status_error(404, {"detail": "model m not found"})
    assert err.message == "model m not found" and err.status_code == 404
    assert isinstance(err, LookupError)
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is type(err) and again.message == err.message
    failed = pickle.loads(pickle.dumps(RequestFailedError("boom", "r1", "user")))
    assert (failed.message, failed.request_id, failed.category) == ("boom", "r1", "user")
    assert status_error(503, None, "down").status_code == 503
