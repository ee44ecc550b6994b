"""A worker that heard nothing from the API for a moment says HELLO again; the hub, which
never lost it, welcomes it as it is: the worker keeps its models, their queues and its
decode batch, and a live session goes on serving on every path.

Before, any second WELCOME made the worker forget every model, while the API (which had
not lost it, so restores nothing) went on sending their ops: a /v1 chat on a live
session's model_id then failed with 404 "no adapter or snapshot with id <model_id>", and
the ops queued at that moment never finished. A busy machine (an agent's rollouts beside
its training) leaves the API's heartbeats API_SILENT_S apart, well short of the hub's
DEAD_AFTER_S.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import openai
import pytest

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from treadle.protocol import messages
from treadle.worker import process

TINY = "treadle/tiny-llama"
WAIT = 60


def _datum(rng: np.random.Generator) -> Datum:
    tokens = rng.integers(0, 200, 17).tolist()
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": np.ones(16, np.float32)},
    )


def _hellos(server) -> int:
    return server.log().count("saying hello again")


def test_a_worker_welcomed_again_by_an_api_that_kept_it_keeps_its_models(start_server, monkeypatch):
    # every gap between the hub's heartbeats (TICK_S) now reads as the API gone silent,
    # as a stalled API process's 2 s do: the worker says HELLO again about once a second
    monkeypatch.setattr(process, "API_SILENT_S", 0.0)
    server = start_server()
    svc = ServiceClient(base_url=server.url)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="tml-local")
    tc = svc.create_lora_training_client(TINY, rank=4, seed=0)
    rng = np.random.default_rng(0)
    chat = dict(messages=[{"role": "user", "content": "2 + 3?"}], max_tokens=4, seed=1)
    try:
        for step in range(3):
            seen = _hellos(server)
            deadline = time.monotonic() + 10
            while _hellos(server) == seen and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _hellos(server) > seen, "the worker never said hello again"
            # the session's live weights, its training and its sampler, after the HELLO
            live = client.chat.completions.create(model=tc.model_id, **chat)
            assert live.choices[0].message.content is not None
            fb = tc.forward_backward([_datum(rng)], loss_fn="cross_entropy")
            opt = tc.optim_step(AdamParams(learning_rate=1e-2))
            fb.result(WAIT), opt.result(WAIT)
            sc = tc.save_weights_and_get_sampling_client()
            params = SamplingParams(max_tokens=4, temperature=1.0, seed=step)
            sc.sample(ModelInput.from_ints([1, 2, 3]), 2, params).result(WAIT)
        assert "forgetting every model" not in server.log()
    finally:
        svc.close()


@pytest.mark.parametrize(
    ("served_before", "restores", "welcomed", "resets"),
    [
        (False, True, False, False),  # the first WELCOME: nothing to forget
        (True, True, False, True),  # a restarted API, or one that lost the worker
        (True, True, True, True),  # ... even after a WELCOME of an earlier HELLO crossed it
        (True, False, False, False),  # an API that kept the worker: it only seemed silent
        (True, False, True, False),  # a duplicate
    ],
)
def test_only_an_api_that_restores_the_models_makes_the_worker_forget_them(
    served_before, restores, welcomed, resets
):
    calls: list[str] = []
    done: Future = Future()
    done.set_result(None)
    worker = SimpleNamespace(
        _epoch="e0" if served_before else None,
        _welcomed=welcomed,
        loop=SimpleNamespace(control=lambda name: calls.append(name) or done),
    )
    process.Worker._welcome(worker, messages.Welcome("e1", restores=restores))
    assert calls == (["reset"] if resets else [])
    assert worker._welcomed
