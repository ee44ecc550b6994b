"""What a training model's state snapshots keep on disk, through the real app and worker:
an RL loop making a sampler every step keeps the folders its last recorded snapshot names
(the samplers it dropped since stay until a newer one is recorded, and then go), an
unloaded model keeps nothing, and a restart removes the folders no row names. The kill that
needs those folders is in tests/acceptance/test_recovery.py.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import httpx
from _inproc import InProcessServer

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient

TINY = "treadle/tiny-llama"
PROBE = [
    Datum(
        model_input=ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
    )
]
CONFIG = {"snapshot_every_steps": 1, "max_snapshots_per_model": 2}


def recorded(data_dir: Path, model_id: str) -> set[str]:
    """The folders the model's recorded snapshot names."""
    with sqlite3.connect(data_dir / "treadle.db") as db:
        row = db.execute(
            "SELECT dir, samplers FROM state_snapshots WHERE model_id = ?", (model_id,)
        ).fetchone()
    return set() if row is None else {row[0], *json.loads(row[1]).values()}


def model_dir_of(data_dir: Path, model_id: str) -> Path:
    """The model's folder of snapshots: where the worker put the recorded state folder."""
    with sqlite3.connect(data_dir / "treadle.db") as db:
        (folder,) = db.execute(
            "SELECT dir FROM state_snapshots WHERE model_id = ?", (model_id,)
        ).fetchone()
    return Path(folder).parent


def on_disk(model_dir: Path) -> set[str]:
    if not model_dir.is_dir():
        return set()
    found = {str(p) for p in model_dir.glob("state-*")}
    return found | {str(p) for p in model_dir.glob("samplers/*")}


def settle(check, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert check()


def test_an_rl_loop_keeps_only_what_its_last_snapshot_names(tiny_model_dir, tmp_path):
    data_dir = tmp_path / "data"
    with InProcessServer({TINY: tiny_model_dir}, data_dir, config=CONFIG) as server:
        svc = ServiceClient(base_url=server.url)
        tc = svc.create_lora_training_client(TINY, rank=4, seed=1)
        params = SamplingParams(max_tokens=3, temperature=1.0, seed=0)
        for _ in range(5):
            sampler = tc.save_weights_and_get_sampling_client()
            seqs = sampler.sample(ModelInput.from_ints([5, 6, 7]), 2, params).result().sequences
            tokens = [5, 6, 7, *seqs[0].tokens]
            datum = Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
            )
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(AdamParams(learning_rate=1e-3)).result()
        # the last snapshot (every step) names its state and the 2 samplers the model holds
        settle(lambda: len(recorded(data_dir, tc.model_id)) == 3)
        model_dir = model_dir_of(data_dir, tc.model_id)
        settle(lambda: on_disk(model_dir) == recorded(data_dir, tc.model_id))

        r = httpx.post(f"{server.url}/api/v1/unload_model", json={"model_id": tc.model_id})
        assert r.status_code == 200, r.text
        settle(lambda: not model_dir.exists() and not recorded(data_dir, tc.model_id))
        svc.close()


def test_a_restart_removes_snapshot_folders_no_row_names(tiny_model_dir, tmp_path):
    data_dir = tmp_path / "data"
    with InProcessServer({TINY: tiny_model_dir}, data_dir, config=CONFIG) as server:
        svc = ServiceClient(base_url=server.url)
        tc = svc.create_lora_training_client(TINY, rank=4, seed=1)
        tc.save_weights_and_get_sampling_client()
        tc.forward_backward(PROBE, "cross_entropy").result()
        tc.optim_step(AdamParams(learning_rate=1e-3)).result()
        settle(lambda: len(recorded(data_dir, tc.model_id)) == 2)  # its state and 1 sampler
        server.stop()  # with the session open: its model is restored at the next start
        named = recorded(data_dir, tc.model_id)
        model_dir = model_dir_of(data_dir, tc.model_id)
        # written and renamed, never recorded: a crash between the two, or a late arrival
        orphans = [
            model_dir / "state-0-1a2b3c4d",
            model_dir / "samplers" / "snap_gone",
            model_dir.parent / "x_train_9" / "state-4-5e6f7a8b",
        ]
        for folder in orphans:
            folder.mkdir(parents=True)
            (folder / "adapter_model.safetensors").write_bytes(b"0")
        assert len(named) == 2 and on_disk(model_dir) == named | {str(f) for f in orphans[:2]}
        server.start()
        assert on_disk(model_dir) == named == recorded(data_dir, tc.model_id)
        assert not any(folder.exists() for folder in orphans)
        assert not (model_dir.parent / "x_train_9").exists()
        tc.forward_backward(PROBE, "cross_entropy").result()  # restored from what was kept
        svc.close()
