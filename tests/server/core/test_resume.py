"""A training state saved by one client process resumes in another, through the tinker SDK.

The first client saves (adapter + Adam moments) after one step, then takes a second step;
a second process loads the state with its optimizer and takes the same second step. Both
must land on the same weights, which only holds if the Adam moments came back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402

API_KEY = "tml-treadle-tests"

SECOND_PROCESS = textwrap.dedent(
    """
    import json, sys
    import tinker
    from tinker import types as T

    url, path, data = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    sc = tinker.ServiceClient(base_url=url, api_key="API_KEY")
    tc = sc.create_training_client_from_state_with_optimizer(path).result()
    datums = [
        T.Datum(model_input=T.ModelInput.from_ints(d["tokens"]),
                loss_fn_inputs={"target_tokens": d["targets"], "weights": d["weights"]})
        for d in data
    ]
    tc.forward_backward(datums, "cross_entropy").result()
    tc.optim_step(T.AdamParams(learning_rate=0.02)).result()
    out = tc.forward(datums, "cross_entropy").result()
    print(json.dumps({
        "model_name": tc.get_info().model_data.model_name,
        "logprobs": [o["logprobs"].tolist() for o in out.loss_fn_outputs],
    }))
    sc.close("success").result()
    """
).replace("API_KEY", API_KEY)


def test_state_saved_in_one_process_resumes_in_another(treadle_server):
    rng = np.random.default_rng(7)
    raw = []
    for n in (6, 9):
        seq = rng.integers(0, 400, n + 1).tolist()
        raw.append({"tokens": seq[:-1], "targets": seq[1:], "weights": [1.0] * n})
    data = [
        T.Datum(
            model_input=T.ModelInput.from_ints(d["tokens"]),
            loss_fn_inputs={"target_tokens": d["targets"], "weights": d["weights"]},
        )
        for d in raw
    ]
    sc = tinker.ServiceClient(base_url=treadle_server.url, api_key=API_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=treadle_server.model_name, rank=4).result()
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(T.AdamParams(learning_rate=0.02)).result()
        path = tc.save_state("resume-me").result().path
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(T.AdamParams(learning_rate=0.02)).result()
        want = [
            o["logprobs"].to_numpy()
            for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs
        ]
    finally:
        sc.close("success").result(timeout=30)  # the first session ends before the second starts

    proc = subprocess.run(
        [sys.executable, "-c", SECOND_PROCESS, treadle_server.url, path, json.dumps(raw)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["model_name"] == treadle_server.model_name
    for g, w in zip(got["logprobs"], want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)
