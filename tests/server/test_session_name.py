"""A session's name is its name everywhere: the name given with `training_session_name`
(the treadle SDK) or `display_name` (the official tinker SDK) is the sessions row's
display_name, and so the console's sessions table, its filter and the session's page, the
usage by session (API and `treadle usage`), and the console's checkpoints list.
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import httpx
import numpy as np

from treadle import AdamParams, Datum, ModelInput, ServiceClient

TINY = "treadle/tiny-llama"
API_KEY = "tml-treadle-tests"  # the tinker SDK insists on the tml- prefix
CONSOLE = "/api/v1/treadle/console"


def _data() -> list[Datum]:
    seq = np.random.default_rng(0).integers(1, 400, 9).tolist()
    targets = {"target_tokens": seq[1:], "weights": [1.0] * 8}
    return [Datum(model_input=ModelInput.from_ints(seq[:-1]), loss_fn_inputs=targets)]


def _table_row(url: str, session_id: str, q: str | None = None) -> dict | None:
    """The console's sessions table (what its page reads), filtered by `q` as its search box
    does: the row of the session, or None."""
    params = {"q": q} if q else {}
    table = httpx.get(f"{url}{CONSOLE}/sessions", params=params, timeout=30).json()
    return next((r for r in table["sessions"] if r["session_id"] == session_id), None)


def test_training_session_name_names_the_session_everywhere(treadle_server):
    url = treadle_server.url
    name = f"my-run-{uuid.uuid4().hex[:6]}"
    svc = ServiceClient(base_url=url)
    tc = svc.create_lora_training_client(TINY, rank=4, training_session_name=name)
    tc.forward_backward(_data(), "cross_entropy").result()
    tc.optim_step(AdamParams(learning_rate=1e-3)).result()
    tc.save_weights_for_sampler("named").result()
    sid = svc.session_id

    # the console's table, its search and the session's page
    assert _table_row(url, sid)["name"] == name
    assert _table_row(url, sid, q=name)["name"] == name
    assert _table_row(url, sid, q=name.upper())  # the search ignores case
    assert _table_row(url, sid, q="no-such-run-name") is None
    assert httpx.get(f"{url}{CONSOLE}/sessions/{sid}", timeout=30).json()["name"] == name

    # the tinker protocol's session, and the console's checkpoints list
    assert httpx.get(f"{url}/api/v1/sessions/{sid}", timeout=30).json()["display_name"] == name
    checkpoints = httpx.get(f"{url}{CONSOLE}/checkpoints", timeout=30).json()["checkpoints"]
    (saved,) = [c for c in checkpoints if c["session_id"] == sid]
    assert saved["session_name"] == name

    # the usage by session: the API and `treadle usage`
    usage = httpx.get(f"{url}/api/v1/treadle/usage", params={"by": "session"}, timeout=30)
    (row,) = [r for r in usage.json()["rows"] if r["key"] == sid]
    assert row["name"] == name and row["requests"] >= 2
    out = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "usage", "--url", url, "--by", "session"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if sid in ln]
    assert name in line.split()
    assert out.stdout.splitlines()[0].split()[:3] == ["tenant", "session", "name"]
    svc.close()


def test_a_session_opened_before_its_training_client_is_named_by_it(treadle_server):
    """The session was opened by a sampling client: the first training client's name
    names it (on the server), and a second name does not rename it."""
    url = treadle_server.url
    svc = ServiceClient(base_url=url)
    svc.create_sampling_client(base_model=TINY)
    sid = svc.session_id
    assert _table_row(url, sid)["name"] == ""
    svc.create_lora_training_client(TINY, rank=4, training_session_name="first-name")
    svc.create_lora_training_client(TINY, rank=4, training_session_name="second-name")
    assert _table_row(url, sid)["name"] == "first-name"
    svc.close()


def test_the_tinker_sdk_display_name_names_the_session(treadle_server, monkeypatch):
    import tinker

    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    name = f"nightly-{uuid.uuid4().hex[:6]}"
    sc = tinker.ServiceClient(base_url=treadle_server.url, display_name=name)
    sc.create_lora_training_client(base_model=TINY, rank=4)
    table = httpx.get(f"{treadle_server.url}{CONSOLE}/sessions", params={"q": name}, timeout=30)
    assert [r["name"] for r in table.json()["sessions"]] == [name]
