"""Tenants and API keys against a real `treadle serve`: authentication, revocation, isolation
(every route, walked with tenant B's key against tenant A's resources), path traversal,
input limits, and both SDKs with real keys.

    .venv/bin/python -m pytest -q tests/acceptance/test_tenants.py
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from _tenancy import TINY, Api, fb_body, make_tenants, start_server

AUTH_TTL_S = 0.5  # how long a key's tenant (or its revocation) is trusted before a re-read
LIMITS = {
    "max_seq_len": {TINY: 40},
    "max_batch_tokens": 60,
    "max_num_samples": 4,
    "max_sample_tokens": 6,
}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("tenants")
    keys = make_tenants(data, {"alice": None, "bob": None})
    config = {"limits": LIMITS, "auth_cache_ttl_s": AUTH_TTL_S}
    srv = start_server({TINY: tiny_model_dir}, data, config=config)
    srv.keys = keys
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def alice(server):
    api = Api(server.url, server.keys["alice"])
    yield api
    api.close()


@pytest.fixture(scope="module")
def bob(server):
    api = Api(server.url, server.keys["bob"], bearer=True)  # the other header form
    yield api
    api.close()


def cli(server, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "treadle.cli", *args, "--data-dir", str(server.data_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


def test_keys_are_required_and_checked(server, alice, treadle_server):
    assert Api(server.url, None).get("healthz").status_code == 200  # public
    no_key = Api(server.url, None).post("create_session", {})
    assert no_key.status_code == 401 and "missing API key" in no_key.json()["error"]
    wrong = Api(server.url, "tml-" + "x" * 43).post("create_session", {})
    assert wrong.status_code == 401 and "not recognised" in wrong.json()["error"]
    assert alice.post("create_session", {}).status_code == 200
    assert "development mode" not in server.log()
    # a server without tenants says at start-up that it runs in development mode
    assert "single-user development mode" in treadle_server.log()


def test_a_revoked_key_stops_within_the_auth_cache_ttl(server):
    key = cli(server, "admin", "create-key", "alice").stdout.strip()
    assert key.startswith("tml-")
    api = Api(server.url, key)  # a new key works at its first request
    sid = api.session()
    assert api.ok("session_heartbeat", {"session_id": sid})
    listed = cli(server, "admin", "list").stdout
    assert key not in listed and key[:12] in listed  # only the key's id is ever shown again
    cli(server, "admin", "revoke-key", key[:12])
    revoked_at = time.monotonic()
    while (after := api.post("session_heartbeat", {"session_id": sid})).status_code == 200:
        # trusted for at most AUTH_TTL_S after its last read (slack: a loaded machine)
        assert time.monotonic() - revoked_at < AUTH_TTL_S + 5.0
        time.sleep(0.05)
    assert after.status_code == 401 and "revoked" in after.json()["error"]


# ---- isolation ----
def _alice_resources(alice: Api) -> dict[str, str]:
    sid = alice.session()
    model = alice.model(sid)
    rid_fb = alice.forward(model, 1, [6, 5], backward=True).json()["request_id"]
    alice.done(rid_fb)
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    alice.done(
        alice.ok("optim_step", {"model_id": model, "seq_id": 2, "adam_params": adam})["request_id"]
    )
    state = alice.done(
        alice.ok("save_weights", {"model_id": model, "seq_id": 3, "path": "ck-a"})["request_id"]
    )["path"]
    sampler_path = alice.done(
        alice.ok("save_weights_for_sampler", {"model_id": model, "seq_id": 4, "path": "sp-a"})[
            "request_id"
        ]
    )["path"]
    snapshot = alice.done(
        alice.ok(
            "save_weights_for_sampler",
            {"model_id": model, "seq_id": 5, "sampling_session_seq_id": 0},
        )["request_id"]
    )["sampling_session_id"]
    sampler = alice.ok(
        "create_sampling_session",
        {"session_id": sid, "sampling_session_seq_id": 1, "model_path": sampler_path},
    )["sampling_session_id"]
    sample = {
        "sampling_session_id": sampler,
        "seq_id": 0,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": 2},
    }
    rid_sample = alice.ok("asample", sample)["request_id"]
    alice.done(rid_sample)
    run = alice.get(f"training_runs/{model}").json()["training_run_id"]
    # a model package group with one version (checkpoint registry)
    grouped = alice.ok(
        "create_model",
        {
            "session_id": sid,
            "model_seq_id": 1,
            "base_model": TINY,
            "lora_config": {"rank": 2},
            "model_package_group": "grp-alice",
        },
    )["model_id"]
    saved = alice.done(
        alice.ok("save_weights", {"model_id": grouped, "seq_id": 1, "path": "v"})["request_id"]
    )
    version = saved["versions"][0] if saved.get("versions") else "grp-alice:1"
    upload = alice.ok(
        "external_weights_upload_start",
        {"base_model": TINY, "name": "up-a", "files": {
            "adapter_config.json": 10, "adapter_model.safetensors": 10}},
    )["upload_id"]  # fmt: skip
    capture = alice.http.post("/api/v1/treadle/captures", json={}).json()["capture_id"]
    return {
        "capture": capture,
        "upload": upload,
        "grouped_model": grouped,
        "model": model,
        "state_path": state,
        "sampler_path": sampler_path,
        "snapshot": snapshot,
        "sampler": sampler,
        "request_fb": rid_fb,
        "request_sample": rid_sample,
        "run": run,
        "session": sid,
        "version": version,
        "group": "grp-alice",
    }


def _fakes(res: dict[str, str]) -> dict[str, str]:
    """Resources of the same shapes that exist for nobody."""
    hexid = lambda: uuid.uuid4().hex[:16]  # noqa: E731
    session, run = hexid(), hexid()
    return {
        "capture": f"cap-{hexid()}",
        "upload": hexid(),
        "grouped_model": f"{session}:train:1",
        "model": f"{session}:train:0",
        "state_path": f"tinker://{run}/weights/ck-a",
        "sampler_path": f"tinker://{run}/sampler_weights/sp-a",
        "snapshot": hexid(),
        "sampler": hexid(),
        "request_fb": hexid(),
        "request_sample": hexid(),
        "run": run,
        "session": session,
        "version": "grp-nobody:1",
        "group": "grp-nobody",
    }


def _sample(sampler: str) -> dict:
    return {
        "sampling_session_id": sampler,
        "seq_id": 7,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
        "sampling_params": {"max_tokens": 2},
    }


def _chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


# (METHOD, route) → the requests tenant B makes with A's resources r (method, path, kwargs)
PROBES = {
    ("POST", "/api/v1/retrieve_future"): lambda r, b: [
        ("POST", "/api/v1/retrieve_future", {"json": {"request_id": r["request_fb"]}}),
        ("POST", "/api/v1/retrieve_future", {"json": {"request_id": r["request_sample"]}}),
    ],
    ("POST", "/api/v1/create_model"): lambda r, b: [
        (
            "POST",
            "/api/v1/create_model",
            {"json": {"session_id": r["session"], "model_seq_id": 9, "base_model": TINY}},
        )
    ],
    ("POST", "/api/v1/get_info"): lambda r, b: [
        ("POST", "/api/v1/get_info", {"json": {"model_id": r["model"]}})
    ],
    ("POST", "/api/v1/forward_backward"): lambda r, b: [
        ("POST", "/api/v1/forward_backward", {"content": fb_body(r["model"], 6, [4])})
    ],
    ("POST", "/api/v1/optim_step"): lambda r, b: [
        (
            "POST",
            "/api/v1/optim_step",
            {"json": {"model_id": r["model"], "seq_id": 6, "adam_params": {"learning_rate": 0.1}}},
        )
    ],
    ("POST", "/api/v1/unload_model"): lambda r, b: [
        ("POST", "/api/v1/unload_model", {"json": {"model_id": r["model"]}})
    ],
    ("POST", "/api/v1/create_sampling_session"): lambda r, b: (
        [
            (
                "POST",
                "/api/v1/create_sampling_session",
                {"json": {"session_id": b, "sampling_session_seq_id": 50, "model_path": r[k]}},
            )
            for k in ("sampler_path", "state_path")
        ]
        + [
            (
                "POST",
                "/api/v1/create_sampling_session",
                {
                    "json": {
                        "session_id": r["session"],
                        "sampling_session_seq_id": 51,
                        "base_model": TINY,
                    }
                },
            )
        ]
    ),
    ("GET", "/api/v1/samplers/{sampler_id}"): lambda r, b: [
        ("GET", f"/api/v1/samplers/{r[k]}", {}) for k in ("sampler", "snapshot")
    ],
    ("POST", "/api/v1/asample"): lambda r, b: [
        ("POST", "/api/v1/asample", {"json": _sample(r[k])}) for k in ("sampler", "snapshot")
    ],
    ("POST", "/api/v1/session_heartbeat"): lambda r, b: [
        ("POST", "/api/v1/session_heartbeat", {"json": {"session_id": r["session"]}})
    ],
    ("POST", "/api/v1/sessions/{session_id}/finish"): lambda r, b: [
        ("POST", f"/api/v1/sessions/{r['session']}/finish", {"json": {}})
    ],
    ("GET", "/api/v1/sessions/{session_id}"): lambda r, b: [
        ("GET", f"/api/v1/sessions/{r['session']}", {})
    ],
    ("POST", "/api/v1/save_weights"): lambda r, b: [
        (
            "POST",
            "/api/v1/save_weights",
            {"json": {"model_id": r["model"], "seq_id": 6, "path": "x"}},
        )
    ],
    ("POST", "/api/v1/save_weights_for_sampler"): lambda r, b: [
        (
            "POST",
            "/api/v1/save_weights_for_sampler",
            {"json": {"model_id": r["model"], "seq_id": 6, "path": "x"}},
        )
    ],
    ("POST", "/api/v1/load_weights"): lambda r, b: (
        [
            (
                "POST",
                "/api/v1/load_weights",
                {"json": {"session_id": b, "model_seq_id": 60, "path": r[k]}},
            )
            for k in ("state_path", "sampler_path")
        ]
        + [
            (
                "POST",
                "/api/v1/load_weights",
                {"json": {"model_id": r["model"], "seq_id": 6, "path": r["state_path"]}},
            )
        ]
    ),
    ("POST", "/api/v1/weights_info"): lambda r, b: [
        ("POST", "/api/v1/weights_info", {"json": {"tinker_path": r[k]}})
        for k in ("state_path", "sampler_path")
    ],
    ("GET", "/api/v1/training_runs/{run_id}"): lambda r, b: [
        ("GET", f"/api/v1/training_runs/{r[k]}", {}) for k in ("run", "model")
    ],
    ("GET", "/api/v1/training_runs/{run_id}/checkpoints"): lambda r, b: [
        ("GET", f"/api/v1/training_runs/{r['run']}/checkpoints", {})
    ],
    ("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}"): lambda r, b: [
        ("DELETE", f"/api/v1/training_runs/{r['run']}/checkpoints/weights/ck-a", {})
    ],
    ("PUT", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/ttl"): lambda r, b: [
        (
            "PUT",
            f"/api/v1/training_runs/{r['run']}/checkpoints/weights/ck-a/ttl",
            {"json": {"ttl_seconds": 60}},
        )
    ],
    (
        "GET",
        "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/external_weights_urls",
    ): lambda r, b: [
        (
            "GET",
            f"/api/v1/training_runs/{r['run']}/checkpoints/sampler_weights/sp-a/external_weights_urls",
            {},
        )
    ],
    ("GET", "/api/v1/treadle/checkpoints/groups/{group}/versions"): lambda r, b: [
        ("GET", f"/api/v1/treadle/checkpoints/groups/{r['group']}/versions", {})
    ],
    ("PUT", "/api/v1/treadle/checkpoints/groups/{group}/retention"): lambda r, b: [
        (
            "PUT",
            f"/api/v1/treadle/checkpoints/groups/{r['group']}/retention",
            {"json": {"keep_last": 1}},
        )
    ],
    ("GET", "/api/v1/treadle/checkpoints/versions/{ref}"): lambda r, b: (
        [("GET", f"/api/v1/treadle/checkpoints/versions/{r[k]}", {}) for k in ("version",)]
        + [("GET", f"/api/v1/treadle/checkpoints/versions/{r['group']}:latest", {})]
    ),
    ("GET", "/api/v1/treadle/checkpoints/versions/{ref}/resolve"): lambda r, b: [
        ("GET", f"/api/v1/treadle/checkpoints/versions/{ref}/resolve", {})
        for ref in (r["version"], f"{r['group']}:latest")
    ],
    ("DELETE", "/api/v1/treadle/checkpoints/versions/{ref}"): lambda r, b: [
        ("DELETE", f"/api/v1/treadle/checkpoints/versions/{r['version']}", {})
    ],
    ("GET", "/api/v1/treadle/checkpoints/versions/{ref}/archive"): lambda r, b: [
        ("GET", f"/api/v1/treadle/checkpoints/versions/{r['version']}/archive", {})
    ],
    ("GET", "/v1/models/{model}"): lambda r, b: [
        ("GET", f"/v1/models/{r[k]}", {})
        for k in ("model", "sampler", "snapshot", "state_path", "sampler_path", "version")
    ],
    ("POST", "/v1/chat/completions"): lambda r, b: [
        ("POST", "/v1/chat/completions", {"json": _chat(r[k])})
        for k in ("model", "sampler", "sampler_path", "version")
    ],
    ("POST", "/v1/messages"): lambda r, b: [
        ("POST", "/v1/messages", {"json": _chat(r[k])})  # the same fields in Anthropic's shape
        for k in ("model", "sampler", "sampler_path", "version")
    ],
    # capture sessions are named within their tenant: B's name is another session
    ("GET", "/api/v1/treadle/captures/{capture_id}/completions"): lambda r, b: [
        ("GET", f"/api/v1/treadle/captures/{r['capture']}/completions", {})
    ],
    ("POST", "/api/v1/treadle/captures/{capture_id}/rewards"): lambda r, b: [
        (
            "POST",
            f"/api/v1/treadle/captures/{r['capture']}/rewards",
            {"json": {"rewards": [{"trajectory_id": "t", "reward": 1.0}]}},
        )
    ],
    ("POST", "/api/v1/treadle/captures/{capture_id}/datums"): lambda r, b: [
        ("POST", f"/api/v1/treadle/captures/{r['capture']}/datums", {"json": {}})
    ],
    ("POST", "/v1/completions"): lambda r, b: [
        (
            "POST",
            "/v1/completions",
            {"json": {"model": r[k], "prompt": "hi", "max_tokens": 2}},
        )
        for k in ("model", "sampler", "sampler_path", "version")
    ],
}
_GRAPH = {"format": 1, "nodes": [
    {"op": "placeholder", "name": "logprobs", "target": "logprobs"},
    {"op": "call_method", "name": "s", "target": "sum", "args": [{"ref": "logprobs"}]},
    {"op": "output", "name": "output", "target": "output",
     "args": [{"tuple": [{"ref": "s"}, {"dict": {}}]}]},
]}  # fmt: skip
CHECKPOINT = "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}"
PROBES.update(
    {
        ("POST", "/api/v1/retrieve_futures"): lambda r, b: [
            (
                "POST",
                "/api/v1/retrieve_futures",
                {"json": {"target": {"sampling_session_id": r[k]}, "timeout": 0}},
            )
            for k in ("sampler", "snapshot")
        ],  # fmt: skip
        ("POST", "/api/v1/cancel_future"): lambda r, b: [
            ("POST", "/api/v1/cancel_future", {"json": {"request_id": r[k]}})
            for k in ("request_fb", "request_sample")
        ],
        ("POST", "/api/v1/join_sampling_session"): lambda r, b: [
            ("POST", "/api/v1/join_sampling_session", {"json": {"sampling_session_id": r[k]}})
            for k in ("sampler", "snapshot")
        ],
        ("POST", "/api/v1/create_custom_loss"): lambda r, b: [
            (
                "POST",
                "/api/v1/create_custom_loss",
                {
                    "json": {
                        "session_id": r["session"],
                        "custom_loss_seq_id": 0,
                        "name": "l",
                        "inputs": [{"name": "logprobs", "rank": 1}],
                        "graph": _GRAPH,
                    }
                },
            )
        ],  # fmt: skip
        ("POST", "/api/v1/copy_weights"): lambda r, b: [
            (
                "POST",
                "/api/v1/copy_weights",
                {"json": {"source_path": r[k], "destination_project_id": "p"}},
            )
            for k in ("state_path", "sampler_path")
        ],  # fmt: skip
        **{
            (method, CHECKPOINT + "/publish"): lambda r, b, method=method: [
                (
                    method,
                    f"/api/v1/training_runs/{r['run']}/checkpoints/sampler_weights/sp-a/publish",
                    {},
                )
            ]  # fmt: skip
            for method in ("POST", "DELETE")
        },
        ("PUT", "/api/v1/sessions/{session_id}/project"): lambda r, b: [
            ("PUT", f"/api/v1/sessions/{r['session']}/project", {"json": {"project_id": "p"}})
        ],
        ("GET", "/api/v1/sessions/{session_id}/trace_export"): lambda r, b: [
            ("GET", f"/api/v1/sessions/{r['session']}/trace_export", {})
        ],
        ("POST", "/api/v1/external_weights_upload_finish"): lambda r, b: [
            ("POST", "/api/v1/external_weights_upload_finish", {"json": {"upload_id": r["upload"]}})
        ],
    }
)
# Listings: tenant B sees none of A's resources in them.
LISTINGS = {
    ("GET", "/api/v1/sessions"),
    ("GET", "/api/v1/training_runs"),
    ("GET", "/api/v1/checkpoints"),
    ("GET", "/api/v1/treadle/checkpoints/groups"),
    ("GET", "/api/v1/treadle/usage"),
    ("GET", "/v1/models"),
    ("POST", "/api/v1/checkpoints/search"),
    ("POST", "/api/v1/sessions/search"),
    ("GET", "/api/v1/billing/usage/events"),
    ("GET", "/api/v1/billing/usage/checkpoints/current"),
    ("GET", "/api/v1/audit"),
}
# The web console: its pages and JSON endpoints for one session, a version's download, and
# the loop's own metrics (treadle.server.console).
CONSOLE_SESSION = "/api/v1/treadle/console/sessions/{session_id}"
PROBES.update(
    {
        ("GET", "/console/sessions/{session_id}"): lambda r, b: [
            ("GET", f"/console/sessions/{r['session']}", {})
        ],
        **{
            ("GET", CONSOLE_SESSION + tail): lambda r, b, tail=tail: [
                ("GET", CONSOLE_SESSION.format(session_id=r["session"]) + tail, {})
            ]
            for tail in ("", "/metrics", "/timeline", "/trace")
        },
        ("GET", "/console/download/{ref}"): lambda r, b: [
            ("GET", f"/console/download/{r['version']}", {})
        ],
        ("POST", "/api/v1/treadle/metrics"): lambda r, b: [
            (
                "POST",
                "/api/v1/treadle/metrics",
                {"json": {"model_id": r[k], "step": 0, "metrics": {"x": 1.0}}},
            )
            for k in ("model", "grouped_model")
        ],
    }
)
LISTINGS |= {
    ("GET", "/console"),
    ("GET", "/console/sessions"),
    ("GET", "/console/checkpoints"),
    ("GET", "/console/usage"),
    ("GET", "/console/playground"),  # what the tenant may chat with: its own, and the bases
    ("GET", "/api/v1/treadle/console/overview"),
    ("GET", "/api/v1/treadle/console/sessions"),
    ("GET", "/api/v1/treadle/console/checkpoints"),
    ("GET", "/api/v1/treadle/console/usage"),
}
# Routes that name no tenant resource.
NO_RESOURCE = {
    ("GET", "/api/v1/healthz"): "health check",
    ("POST", "/api/v1/client/config"): "client bootstrap",
    ("POST", "/api/v1/client/dynamic_config"): "client bootstrap",
    ("POST", "/api/v1/telemetry"): "accepted and dropped",
    ("GET", "/api/v1/get_server_capabilities"): "the served base models",
    ("GET", "/api/v1/treadle/status"): "worker groups' health: counts only, no tenant's ids",
    ("GET", "/api/v1/treadle/prices"): "the served models' price table",
    ("GET", "/metrics"): "an operator's: a tenant's key gets 403 (tests/server/observe)",
    ("POST", "/api/v1/create_session"): "makes a session of the caller",
    ("POST", "/api/v1/save_weights_external"): "always refused",
    ("GET", "/api/v1/treadle/models/{name}/tokenizer"): "a served base model's tokenizer",
    ("POST", "/api/v1/treadle/checkpoints/groups/{group}/import"): "imports into the caller's "
    "own group namespace (a same-named group of another tenant is a different group)",
    ("GET", "/api/v1/treadle/files/{token}/{name}"): "a signed link: the signature is the grant; "
    "B cannot get one for A's checkpoint (external_weights_urls is probed)",
    ("PUT", "/api/v1/treadle/uploads/{token}"): "a signed link of an upload: the signature is "
    "the grant (B cannot finish A's upload: external_weights_upload_finish is probed)",
    ("GET", "/api/v1/treadle/traces/{token}"): "a signed link of a session's trace: the "
    "signature is the grant; B cannot get one for A's session (trace_export is probed)",
    ("POST", "/api/v1/external_weights_upload_start"): "starts an upload of the caller's own",
    ("POST", "/api/v1/treadle/captures"): "makes (or keeps) a capture session of the caller's "
    "own: a name is looked up only among the caller's (the capture probes check it)",
    ("GET", "/api/v1/auth/apikey/me"): "the presented key's own metadata",
    ("DELETE", "/api/v1/auth/apikey/me"): "revokes the presented key itself, never another",
    ("POST", "/api/v1/auth/token"): "exchanges the presented key for a token of it",
}


def _routes() -> set[tuple[str, str]]:
    from treadle.server.app import create_app
    from treadle.server.config import ServerConfig

    spec = create_app(ServerConfig(models={TINY: "unused"})).openapi()
    return {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}


def _as_missing(text: str, real: dict[str, str], fake: dict[str, str]) -> str:
    for k in sorted(real, key=lambda k: -len(real[k])):
        text = text.replace(real[k], fake[k])
    return text


def test_isolation_every_route(server, alice, bob):
    routes = _routes()
    known = set(PROBES) | LISTINGS | set(NO_RESOURCE)
    assert routes <= known, f"routes without an isolation probe: {sorted(routes - known)}"

    res = _alice_resources(alice)
    fake = _fakes(res)
    bob_session = bob.session()
    for route in sorted(PROBES):
        if route not in routes:
            continue
        theirs = PROBES[route](res, bob_session)
        nobodys = PROBES[route](fake, bob_session)
        for (method, path, kw), (_, fpath, fkw) in zip(theirs, nobodys, strict=True):
            got = bob.http.request(method, path, **kw)
            missing = bob.http.request(method, fpath, **fkw)
            where = f"{method} {path}"
            assert got.status_code == 404, (where, got.status_code, got.text)
            assert missing.status_code == 404, (where, missing.status_code, missing.text)
            assert _as_missing(got.text, res, fake) == missing.text, where
            for value in res.values():
                assert value not in _as_missing(got.text, res, fake)
    for method, path in sorted(LISTINGS & routes):
        got = bob.http.request(method, path)
        assert got.status_code == 200, (path, got.text)
        for key in ("model", "run", "session", "state_path", "sampler", "group"):
            assert res[key] not in got.text, (path, key)
        assert "alice" not in got.text, path

    # A's resources are all still there and A's own (nothing B did touched them)
    assert alice.post("get_info", {"model_id": res["model"]}).status_code == 200
    assert alice.post("weights_info", {"tinker_path": res["state_path"]}).status_code == 200
    assert alice.get(f"samplers/{res['sampler']}").status_code == 200
    assert alice.result(res["request_fb"]).status_code == 200
    assert res["state_path"] in alice.get("checkpoints").text
    assert res["session"] in alice.get("sessions").text


def test_paths_cannot_leave_the_tenants_area(alice, bob):
    sid = alice.session()
    model = alice.model(sid)
    state = alice.done(
        alice.ok("save_weights", {"model_id": model, "seq_id": 1, "path": "mine"})["request_id"]
    )["path"]
    run = state.split("/")[2]
    for name in ("../x", "a/../../b", "..", "/etc/passwd", ".hidden", "a\\..\\b"):
        r = alice.post("save_weights", {"model_id": model, "seq_id": 2, "path": name})
        assert r.status_code == 400 and "path" in r.json()["error"], name
    evil = [
        "tinker://../weights/mine",
        f"tinker://{run}/weights/../mine",
        f"tinker://{run}/weights/mine/../mine",
        f"tinker://{run}/../{run}/weights/mine",
        f"tinker://{run}/weights/..%2fmine",
        "/etc/passwd",
        f"file://{run}/weights/mine",
    ]
    for api in (alice, bob):
        for path in evil:
            r = api.post("weights_info", {"tinker_path": path})
            assert r.status_code in (400, 404), (path, r.status_code)
            r = api.post(
                "create_sampling_session",
                {"session_id": api.session(), "sampling_session_seq_id": 0, "model_path": path},
            )
            assert r.status_code in (400, 404), (path, r.status_code)
    assert alice.post("weights_info", {"tinker_path": state}).status_code == 200
    assert bob.post("weights_info", {"tinker_path": state}).status_code == 404


# ---- input limits ----
def test_input_limits_name_the_limit_and_the_value(alice):
    sid = alice.session()
    model = alice.model(sid)
    too_long = alice.forward(model, 1, [41])
    assert too_long.status_code == 400
    assert "max_seq_len 40" in too_long.json()["error"] and "41" in too_long.json()["error"]
    big = alice.forward(model, 2, [30, 31])
    assert big.status_code == 400 and "max_batch_tokens 60" in big.json()["error"]
    assert "61" in big.json()["error"]
    ok = alice.forward(model, 3, [30, 30])  # the refused seq_ids do not block the model
    assert "error" not in alice.done(ok.json()["request_id"])

    sampler = alice.sampler(sid)

    def sample(**kw):
        body = {**_sample(sampler), "seq_id": None, "num_samples": 1, **kw}
        return alice.post("asample", body)

    r = sample(num_samples=5)
    assert r.status_code == 400 and "max_num_samples 4" in r.json()["error"] and "5" in r.text
    r = sample(sampling_params={"max_tokens": 7})
    assert r.status_code == 400 and "max_sample_tokens 6" in r.json()["error"]
    long_prompt = {"chunks": [{"type": "encoded_text", "tokens": [5] * 36}]}
    r = sample(prompt=long_prompt, sampling_params={"max_tokens": 5})
    assert r.status_code == 400 and "max_seq_len 40" in r.json()["error"]
    # no max_tokens: the sample gets the room the limits leave, not the model's whole context
    r = sample(sampling_params={"temperature": 1.0, "stop": []}, num_samples=4)
    seqs = alice.done(r.json()["request_id"])["sequences"]
    assert [len(s["tokens"]) for s in seqs] == [6] * 4


# ---- both SDKs with real keys ----
def test_tinker_sdk_with_a_real_key(server):
    tinker = pytest.importorskip("tinker")
    from tinker import types as T

    sc = tinker.ServiceClient(base_url=server.url, api_key=server.keys["alice"])
    try:
        tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
        rng = np.random.default_rng(0)
        seq = rng.integers(0, 200, 9).tolist()
        datum = T.Datum(
            model_input=T.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * 8},
        )
        out = tc.forward_backward([datum], "cross_entropy").result()
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 8
        tc.optim_step(T.AdamParams(learning_rate=1e-3)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        res = sampler.sample(
            T.ModelInput.from_ints(seq[:4]), 2, T.SamplingParams(max_tokens=3, seed=1)
        ).result()
        assert len(res.sequences) == 2 and all(1 <= len(s.tokens) <= 3 for s in res.sequences)
        run = tc.model_id
    finally:
        sc.close("success").result(timeout=30)
    other = tinker.RestClient(base_url=server.url, api_key=server.keys["bob"])
    with pytest.raises(tinker.NotFoundError):
        other.get_training_run(run).result()
    bad = tinker.ServiceClient(base_url=server.url, api_key="tml-" + "y" * 43)
    with pytest.raises(tinker.AuthenticationError):
        bad.create_lora_training_client(base_model=TINY, rank=4).result()


def test_treadle_sdk_with_a_real_key(server):
    from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
    from treadle.client.errors import AuthenticationError, NotFoundError

    svc = ServiceClient(base_url=server.url, api_key=server.keys["bob"])
    tc = svc.create_lora_training_client(TINY, rank=4)
    seq = list(range(10, 19))
    datum = Datum(
        model_input=ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": np.ones(8, np.float32)},
    )
    out = tc.forward_backward([datum], "cross_entropy").result(timeout=120)
    assert out.loss_fn_outputs[0]["logprobs"].to_numpy().shape == (8,)
    tc.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=120)
    sampler = tc.save_weights_and_get_sampling_client()
    res = sampler.sample(ModelInput.from_ints(seq[:4]), 1, SamplingParams(max_tokens=3)).result(
        timeout=120
    )
    assert 1 <= len(res.sequences[0].tokens) <= 3
    saved = tc.save_state("treadle-key").result(timeout=120).path
    assert svc.get_usage()["total"]["train_tokens"] == 8  # bob's one forward_backward
    svc.create_training_client_from_state(saved).stop()  # bob's own checkpoint: fine
    svc.close()
    alice = ServiceClient(base_url=server.url, api_key=server.keys["alice"])
    with pytest.raises(NotFoundError):
        alice.create_training_client_from_state(saved)
    alice.close()
    with pytest.raises(AuthenticationError):
        ServiceClient(base_url=server.url, api_key="tml-" + "z" * 43).create_lora_training_client(
            TINY, rank=4
        )
