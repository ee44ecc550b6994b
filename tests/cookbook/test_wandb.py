"""A recipe with `wandb_project` logs to Weights & Biases (offline mode: WANDB_MODE=offline):
the run's transaction log under its run folder holds the recipe's config and every step's
metrics, as metrics.jsonl has them. The log is read here with a plain reader of its format
(LevelDB's log records of W&B's protobuf Records), not with wandb's own code.

    .venv/bin/python -m pytest -q tests/cookbook/test_wandb.py
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from treadle.cookbook.recipes import chat_sft

pb = pytest.importorskip(
    "wandb.proto.wandb_internal_pb2", reason="needs wandb (the cookbook extra)"
)
MODEL = "treadle/tiny-llama"


def wandb_records(path: Path) -> list:
    """The Records of a .wandb file: a 7-byte header, then 32 KiB blocks of records
    (crc32: 4 bytes, length: 2, type: 1 (full), 2 (first), 3 (middle), 4 (last))."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, out, part = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and n == 0:
            break
        part += data[pos : pos + n]
        pos += n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def test_chat_sft_logs_to_wandb_offline(treadle_server, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Say {i}."},
                {"role": "assistant", "content": f"{i}"},
            ]
        }
        for i in range(12)
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = chat_sft.Config(
        model=MODEL,
        dataset=str(data),
        run_dir=str(tmp_path / "run"),
        base_url=treadle_server.url,
        n_test=4,
        batch_size=4,
        max_length=64,
        max_steps=3,
        eval_every=2,
        save_every=0,
        wandb_project="treadle-tests",
        wandb_name="chat-sft",
    )
    run = chat_sft.main(cfg)
    (log,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    # W&B's own process writes the file: wait for its last record
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        records = wandb_records(log)
        if records and records[-1].WhichOneof("record_type") == "exit":
            break
        time.sleep(0.2)
    (start,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (start.project, start.display_name) == ("treadle-tests", "chat-sft")
    config = {i.key: json.loads(i.value_json) for i in start.config.update}
    assert config["batch_size"] == 4 and config["max_steps"] == 3 and config["model"] == MODEL
    history = [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    logged = run.metrics()  # metrics.jsonl
    assert [h["_step"] for h in history] == [m["step"] for m in logged] == [0, 1, 2]
    for h, m in zip(history, logged, strict=True):
        for key in ("train/nll", "lr", "train/tokens"):
            assert h[key] == pytest.approx(m[key], rel=1e-12)
    assert "test/nll" in history[1]
    assert records[-1].WhichOneof("record_type") == "exit"  # the run finished
