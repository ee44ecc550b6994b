"""PostgreSQL as the API's database, end to end: a real `treadle serve --db postgresql://...`
is killed with SIGKILL in the middle of an SFT loop and started again on the same database
and data folder; the loop finishes with exactly the steps it asked for and the logprobs of
an uninterrupted run on SQLite (1e-5, fp32). Nothing acknowledged is lost on PostgreSQL
either.

    .venv/bin/python -m pytest -q tests/acceptance/test_postgres_durability.py
"""

from __future__ import annotations

import numpy as np

from treadle.launch import ServerProcess

TINY = "treadle/tiny-llama"
STEPS = 12


def _loop(url: str, on_step=None):
    from treadle import AdamParams, Datum, ModelInput, ServiceClient

    def data(step: int) -> list[Datum]:
        seq = np.random.default_rng(step).integers(1, 400, 10)
        return [
            Datum(
                model_input=ModelInput.from_ints(seq[:-1].tolist()),
                loss_fn_inputs={"target_tokens": seq[1:].tolist(), "weights": [1.0] * 9},
            )
        ]

    svc = ServiceClient(base_url=url)
    tc = svc.create_lora_training_client(TINY, rank=4, seed=7)
    for step in range(STEPS):
        if on_step is not None:
            on_step(step)
        fb = tc.forward_backward(data(step), "cross_entropy")
        op = tc.optim_step(AdamParams(learning_rate=1e-2))
        fb.result()
        op.result()
    out = tc.forward(data(999), "cross_entropy").result()
    svc.close()
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def test_a_loop_survives_a_kill_of_a_server_on_postgresql(pg_url, tiny_model_dir, tmp_path):
    config = {"snapshot_every_steps": 3}
    with ServerProcess({TINY: tiny_model_dir}, tmp_path / "ref", config=config) as ref:
        want = _loop(ref.url)
    server = ServerProcess(
        {TINY: tiny_model_dir}, tmp_path / "data", config={**config, "db_url": pg_url}
    ).start()
    kills = []

    def on_step(step: int) -> None:
        if step in (4, 9):  # after some acknowledged steps: the server dies and comes back
            server.kill()
            server.start()
            kills.append(step)

    try:
        got = _loop(server.url, on_step)
    finally:
        server.stop()
    assert kills == [4, 9]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)
