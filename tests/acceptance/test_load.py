"""Many tenants at once through a real `treadle serve` with its engine worker: `bench/load.py`
runs client processes that each train a live session and chat with it over /v1, beside
base-model sampling; no operation may fail, streamed or not.

Before the fix, a chat's copy of its session's weights (a pin) was freed when its op ended
while its finished row was still in the decode batch, so the next decode step failed for
every op in the batch ("no adapter or snapshot with id 'pin:...'").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TINY_MODEL_NAME = "treadle/tiny-llama"  # as tests/conftest.py serves it
BENCH = Path(__file__).parents[2] / "bench" / "load.py"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_concurrent_sessions_train_and_chat_without_a_failure(treadle_server, stream):
    cmd = [sys.executable, str(BENCH), "--url", treadle_server.url, "--model", TINY_MODEL_NAME]
    cmd += ["--clients", "12", "--seconds", "15", *(["--stream"] if stream else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["failures"] == 0, out["failures_by_kind"]
    assert out["ops"]["chat"]["n"] >= 12  # every client chatted
    assert {"forward_backward", "optim_step", "sample", "chat"} <= out["ops"].keys()
