"""Property-based probing of every route of the OpenAPI schema (schemathesis), against a
real `treadle serve` with tenants, as one tenant: whatever it sends, no answer is a 5xx.

Generated bodies name ids that do not exist, so they would stop at the first 404; where a
body or path names a session, model, sampler, run or group, the tenant's real ones are put
in (except on routes that end or delete them), so that the checks behind the lookup are
probed too. The quick variant runs a few examples per route (`make test`); the slow one
many more:

    .venv/bin/python -m pytest -q tests/server/api/test_containment_schema.py
    .venv/bin/python -m pytest -q -m slow tests/server/api/test_containment_schema.py
"""

from __future__ import annotations

import pytest
from _tenancy import TINY, Api, make_tenants, start_server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

# Routes that end or delete what they name keep their generated ids.
DESTRUCTIVE = ("/finish", "/unload_model", "/retention")
QUICK = settings(
    max_examples=25,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
SLOW = settings(QUICK, max_examples=200)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("containment-schema")
    keys = make_tenants(data, {"alice": None, "bob": None})
    config = {"heartbeat_timeout_s": 3600, "long_poll_s": 2}
    srv = start_server({TINY: tiny_model_dir}, data, config=config)
    srv.keys = keys
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def real_ids(server) -> dict[str, str]:
    """A session with a training model (in a model package group, one saved version) and a
    sampler, all alice's."""
    api = Api(server.url, server.keys["alice"])
    sid = api.session()
    body = {"session_id": sid, "model_seq_id": 0, "base_model": TINY,
            "lora_config": {"rank": 4}, "model_package_group": "probe"}  # fmt: skip
    model = api.ok("create_model", body)
    api.done(model["request_id"])
    mid = model["model_id"]
    saved = api.done(
        api.ok("save_weights", {"model_id": mid, "seq_id": 1, "path": "s"})["request_id"]
    )
    sampler = api.ok("create_sampling_session",
                     {"session_id": sid, "sampling_session_seq_id": 0, "base_model": TINY})  # fmt: skip
    run = api.get(f"training_runs/{mid}").json()["training_run_id"]
    api.close()
    return {
        "session_id": sid,
        "model_id": mid,
        "sampling_session_id": sampler["sampling_session_id"],
        "sampler_id": sampler["sampling_session_id"],
        "run_id": run,
        "group": "probe",
        "ref": "probe:1",
        "path": saved["path"],
        "tinker_path": saved["path"],
        "base_model": TINY,
        "model": TINY,  # the OpenAI routes' served model
        "name": TINY,
    }


def _schema():
    """The app's OpenAPI schema, read without serving (the routes do not depend on models)."""
    from treadle.server.app import create_app
    from treadle.server.config import ServerConfig

    return create_app(ServerConfig(models={TINY: "unused"})).openapi()


schema = schemathesis.openapi.from_dict(_schema())


def with_real_ids(case, ids: dict[str, str]) -> None:
    """Put the tenant's real ids where the generated case names one."""
    path = case.operation.path
    if path.endswith(DESTRUCTIVE) or case.operation.method.upper() == "DELETE":
        return
    for params in (case.path_parameters, case.query):
        for key in list(params or {}):
            if key in ids:
                params[key] = ids[key]
    if isinstance(case.body, dict):
        for key in case.body:
            if key in ids and (key != "path" or str(case.body[key]).startswith("tinker://")):
                case.body[key] = ids[key]


def probe(case, server, real_ids) -> None:
    with_real_ids(case, real_ids)
    headers = {"X-API-Key": server.keys["alice"]}
    try:
        response = case.call(base_url=server.url, headers=headers, timeout=60)
    except Exception:
        if not server.running():  # say why, rather than fail every later route
            pytest.fail(f"the server exited:\n{server.log()[-4000:]}")
        raise
    case.validate_response(response, checks=[not_a_server_error])


@schema.parametrize()
@QUICK
def test_no_route_answers_a_5xx(case, server, real_ids):
    probe(case, server, real_ids)


@pytest.mark.slow
@schema.parametrize()
@SLOW
def test_no_route_answers_a_5xx_slow(case, server, real_ids):
    probe(case, server, real_ids)
