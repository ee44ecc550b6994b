"""No timing oracle for a leaked id: another tenant's live session, model, sampler or future
is answered by the same code path as an id that does not exist, which we check by counting
what each costs in database statements (a time comparison would flake on a busy machine).

The app runs in this process (TestClient), so that every statement it sends, from any of
its threads, is seen by one SQLAlchemy event listener.

    .venv/bin/python -m pytest -q tests/acceptance/test_containment_oracle.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import pytest
from _tenancy import TINY, make_tenants
from fastapi.testclient import TestClient
from sqlalchemy import event
from sqlalchemy.engine import Engine

UNKNOWN = "0123456789abcdef"
REPEATS = 7


@pytest.fixture(scope="module")
def app(tiny_model_dir, tmp_path_factory):
    from treadle.server.app import create_app
    from treadle.server.config import ServerConfig

    data = tmp_path_factory.mktemp("containment-oracle")
    keys = make_tenants(data, {"alice": None, "bob": None})
    config = ServerConfig(models={TINY: str(tiny_model_dir)}, data_dir=str(data))
    with TestClient(create_app(config)) as client:
        client.keys = keys
        yield client


def call(app: TestClient, tenant: str, method: str, path: str, body=None):
    headers = {"X-API-Key": app.keys[tenant]}
    return app.request(method, f"/api/v1/{path}", json=body, headers=headers)


def done(app: TestClient, request_id: str) -> dict:
    for _ in range(600):
        body = call(app, "alice", "POST", "retrieve_future", {"request_id": request_id}).json()
        if body.get("type") != "try_again":
            return body
    raise TimeoutError(request_id)


@pytest.fixture(scope="module")
def alices(app) -> dict[str, str]:
    """Live resources of alice's, held in the server's memory."""
    sid = call(app, "alice", "POST", "create_session", {}).json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": 2}}
    model = call(app, "alice", "POST", "create_model", body).json()
    assert "error" not in done(app, model["request_id"])
    sampler = call(app, "alice", "POST", "create_sampling_session",
                   {"session_id": sid, "sampling_session_seq_id": 0, "base_model": TINY}
                   ).json()["sampling_session_id"]  # fmt: skip
    sample = {"sampling_session_id": sampler, "seq_id": 0, "num_samples": 1,
              "prompt": {"chunks": [{"tokens": [1, 2, 3]}]}, "sampling_params": {"max_tokens": 1}}  # fmt: skip
    future = call(app, "alice", "POST", "asample", sample).json()["request_id"]
    time.sleep(1.0)  # it finishes; alice never polls it, so it stays in memory
    return {"session": sid, "model": model["model_id"], "sampler": sampler, "future": future}


PROBES: dict[str, Callable[[str], tuple[str, str, dict | None]]] = {
    "session": lambda i: ("POST", "session_heartbeat", {"session_id": i}),
    "model": lambda i: ("POST", "get_info", {"model_id": i}),
    "sampler": lambda i: ("GET", f"samplers/{i}", None),
    "future": lambda i: ("POST", "retrieve_future", {"request_id": i}),
}


class Statements:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, *args) -> None:
        self.n += 1


def cost(app: TestClient, method: str, path: str, body) -> tuple[int, float, int, str]:
    """(database statements, seconds, status, error) of one call of bob's."""
    counter = Statements()
    event.listen(Engine, "before_cursor_execute", counter)
    try:
        t0 = time.perf_counter()
        resp = call(app, "bob", method, path, body)
        elapsed = time.perf_counter() - t0
    finally:
        event.remove(Engine, "before_cursor_execute", counter)
    return counter.n, elapsed, resp.status_code, resp.json().get("error", "")


@pytest.mark.parametrize("kind", list(PROBES))
def test_another_tenants_id_costs_what_an_unknown_id_costs(app, alices, kind):
    theirs, unknown = [], []
    for _ in range(REPEATS):
        theirs.append(cost(app, *PROBES[kind](alices[kind])))
        unknown.append(cost(app, *PROBES[kind](UNKNOWN)))
    # the same answer, but for the id it names
    assert {(s, e.replace(alices[kind], "ID")) for _, _, s, e in theirs} == {
        (s, e.replace(UNKNOWN, "ID")) for _, _, s, e in unknown
    }
    assert theirs[0][2] == 404, theirs[0]
    # the same work: as many database statements (the fewest seen, against background noise)
    assert min(n for n, *_ in theirs) == min(n for n, *_ in unknown), (theirs, unknown)
    median = {
        k: statistics.median(t for _, t, *_ in v)
        for k, v in (("theirs", theirs), ("unknown", unknown))
    }
    print(f"{kind}: median {median['theirs'] * 1e3:.2f} ms (another tenant's) vs "
          f"{median['unknown'] * 1e3:.2f} ms (unknown)")  # fmt: skip
