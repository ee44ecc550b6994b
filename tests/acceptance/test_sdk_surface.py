"""The whole public surface of the installed tinker SDK against a real `treadle serve`.

Every public method of its ServiceClient, TrainingClient, SamplingClient and RestClient is
called here, in an order where each has what it needs, or named in NOT_APPLICABLE with why.
A test fails when the SDK grows a method this walk does not know, and after the walk the
server's own request counter (GET /metrics) must hold no 404 and no 5xx for any route: the
SDK retries 5xx answers itself, so its exceptions alone would not show them.

The server runs with tenants and jwt_auth on, so the SDK exchanges its key for a token
(POST /api/v1/auth/token) first and `whoami` has its claims.

    .venv/bin/python -m pytest -q tests/acceptance/test_sdk_surface.py
"""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import pickle
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch
from _tenancy import TINY, make_tenants, start_server

tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402
from tinker.lib.api_future_impl import QueueState  # noqa: E402

WAIT = 180
CLASSES = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")
NOT_APPLICABLE = {
    "ServiceClient.holder": "an attribute (the client's connection), not a call",
    "TrainingClient.get_tokenizer": "AutoTokenizer.from_pretrained from the Hugging Face Hub, "
    "in the SDK: no request reaches the server (the treadle SDK gets a served model's "
    "tokenizer from GET /api/v1/treadle/models/{name}/tokenizer)",
    "SamplingClient.get_tokenizer": "as TrainingClient.get_tokenizer: the Hub, not the server",
}


def public_methods() -> set[str]:
    return {
        f"{cls}.{name}"
        for cls in CLASSES
        for name, _ in inspect.getmembers(getattr(tinker, cls))
        if not name.startswith("_")
    }


def done(value: Any) -> Any:
    """A call's value: awaited (deprecated async variants), or its future's result."""
    if inspect.iscoroutine(value):

        async def wait() -> Any:
            return done(await value)

        return asyncio.run(wait())
    result = getattr(value, "result", None)
    return result(timeout=WAIT) if callable(result) else value


def neg_ll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def client_side_loss(data, logprobs_list):
    loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].data)).sum()
               for d, lp in zip(data, logprobs_list, strict=True))  # fmt: skip
    return loss, {"custom:sum": float(loss)}


DATUM = T.Datum(
    model_input=T.ModelInput.from_ints([5, 6, 7, 8]),
    loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0, 1.0, 1.0, 1.0]},
)
PROMPT = T.ModelInput.from_ints([5, 6, 7])
PARAMS = T.SamplingParams(max_tokens=3, seed=1)


class Walk:
    """What the calls build on: the clients, and the paths and ids made along the way."""

    def __init__(self, url: str, key: str):
        self.url, self.key = url, key
        self.svc = tinker.ServiceClient(base_url=url, api_key=key, project_id="walk")
        self.rest = tinker.RestClient(base_url=url, api_key=key)
        self.called: set[str] = set()

    def session_id(self) -> str:
        return self.svc.holder.get_session_id()


def steps(w: Walk) -> list[tuple[str, Callable[[], Any]]]:
    """(Class.method, the call), in order."""
    now = dt.datetime.now(dt.UTC).replace(minute=0, second=0, microsecond=0)
    hour = dt.timedelta(hours=1)
    s: list[tuple[str, Callable[[], Any]]] = []
    add = s.append
    svc, rest = w.svc, w.rest

    # ---- the service client: training clients, samplers, capabilities ----
    add(("ServiceClient.get_server_capabilities", svc.get_server_capabilities))
    add(("ServiceClient.get_server_capabilities_async", svc.get_server_capabilities_async))
    add(("ServiceClient.get_console_url", svc.get_console_url))
    add(("ServiceClient.get_telemetry", svc.get_telemetry))
    add(("ServiceClient.create_rest_client", svc.create_rest_client))

    def make_tc() -> Any:
        w.tc = done(svc.create_lora_training_client(base_model=TINY, rank=2, seed=0))
        return w.tc

    add(("ServiceClient.create_lora_training_client", make_tc))
    add(("ServiceClient.create_lora_training_client_async",
         lambda: svc.create_lora_training_client_async(base_model=TINY, rank=2)))  # fmt: skip

    # ---- training ----
    tc = lambda: w.tc  # noqa: E731
    add(("TrainingClient.get_info", lambda: tc().get_info()))
    add(("TrainingClient.get_info_async", lambda: tc().get_info_async()))
    add(("TrainingClient.get_console_url", lambda: tc().get_console_url()))
    add(("TrainingClient.get_telemetry", lambda: tc().get_telemetry()))
    add(("TrainingClient.forward", lambda: tc().forward([DATUM], "cross_entropy")))
    add(("TrainingClient.forward_async", lambda: tc().forward_async([DATUM], "cross_entropy")))
    add(("TrainingClient.forward_backward",
         lambda: tc().forward_backward([DATUM], "cross_entropy")))  # fmt: skip
    add(("TrainingClient.forward_backward_async",
         lambda: tc().forward_backward_async([DATUM], "cross_entropy")))  # fmt: skip

    def custom_loss() -> Any:
        w.handle = done(svc.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}))
        assert w.handle.loss_id is not None  # runs on the server
        return w.handle

    add(("ServiceClient.create_custom_loss", custom_loss))
    add(("TrainingClient.forward_backward_custom",
         lambda: tc().forward_backward_custom([DATUM], w.handle)))  # fmt: skip
    add(("TrainingClient.forward_backward_custom_async",
         lambda: tc().forward_backward_custom_async([DATUM], client_side_loss)))  # fmt: skip
    add(("TrainingClient.optim_step", lambda: tc().optim_step(T.AdamParams(learning_rate=1e-3))))
    add(("TrainingClient.optim_step_async",
         lambda: tc().optim_step_async(T.AdamParams(learning_rate=1e-3))))  # fmt: skip

    def save_state() -> Any:
        w.state = done(tc().save_state("walk-state", user_metadata={"walk": "1"})).path
        return w.state

    def save_sampler() -> Any:
        w.sampler = done(tc().save_weights_for_sampler("walk-sampler")).path
        return w.sampler

    def save_external() -> Any:
        w.external = done(tc().save_weights_external("walk-external")).path
        return w.external

    add(("TrainingClient.save_state", save_state))
    add(("TrainingClient.save_state_async", lambda: tc().save_state_async("walk-state-2")))
    add(("TrainingClient.save_weights_for_sampler", save_sampler))
    add(("TrainingClient.save_weights_for_sampler_async",
         lambda: tc().save_weights_for_sampler_async("walk-sampler-2")))  # fmt: skip
    add(("TrainingClient.save_weights_external", save_external))
    add(("TrainingClient.save_weights_external_async",
         lambda: tc().save_weights_external_async("walk-external-2")))  # fmt: skip
    add(("TrainingClient.load_state", lambda: tc().load_state(w.state)))
    add(("TrainingClient.load_state_async", lambda: tc().load_state_async(w.state)))
    add(("TrainingClient.load_state_with_optimizer",
         lambda: tc().load_state_with_optimizer(w.state)))  # fmt: skip
    add(("TrainingClient.load_state_with_optimizer_async",
         lambda: tc().load_state_with_optimizer_async(w.state)))  # fmt: skip

    def snapshot_sampler() -> Any:
        w.sc = done(tc().save_weights_and_get_sampling_client())
        return w.sc

    add(("TrainingClient.save_weights_and_get_sampling_client", snapshot_sampler))
    add(("TrainingClient.save_weights_and_get_sampling_client_async",
         lambda: tc().save_weights_and_get_sampling_client_async()))  # fmt: skip
    add(("TrainingClient.create_sampling_client", lambda: tc().create_sampling_client(w.sampler)))
    add(("TrainingClient.create_sampling_client_async",
         lambda: tc().create_sampling_client_async(w.sampler)))  # fmt: skip

    # ---- sampling ----
    sc = lambda: w.sc  # noqa: E731
    add(("SamplingClient.sample", lambda: sc().sample(PROMPT, 2, PARAMS)))
    add(("SamplingClient.sample_async", lambda: sc().sample_async(PROMPT, 1, PARAMS)))
    add(("SamplingClient.compute_logprobs", lambda: sc().compute_logprobs(PROMPT)))
    add(("SamplingClient.compute_logprobs_async", lambda: sc().compute_logprobs_async(PROMPT)))
    add(("SamplingClient.get_base_model", lambda: sc().get_base_model()))
    add(("SamplingClient.get_base_model_async", lambda: sc().get_base_model_async()))
    add(("SamplingClient.get_telemetry", lambda: sc().get_telemetry()))
    add(("SamplingClient.on_queue_state_change",
         lambda: sc().on_queue_state_change(QueueState.PAUSED_CAPACITY, "a test says so")))  # fmt: skip

    def handle() -> Any:
        w.handle_str = sc().get_sampler_handle()
        return w.handle_str

    def from_handle() -> Any:  # joins the sampling session (join_sampling_session)
        clone = tinker.SamplingClient.from_sampler_handle(w.handle_str, api_key=w.key)
        return done(clone.sample(PROMPT, 1, PARAMS))

    add(("SamplingClient.get_sampler_handle", handle))
    add(("SamplingClient.from_sampler_handle", from_handle))
    add(("SamplingClient.create",
         lambda: done(tinker.SamplingClient.create(svc.holder, base_model=TINY))
         .sample(PROMPT, 1, PARAMS)))  # fmt: skip
    add(("ServiceClient.create_sampling_client",
         lambda: done(svc.create_sampling_client(base_model=TINY))
         .compute_logprobs(PROMPT)))  # fmt: skip
    add(("ServiceClient.create_sampling_client_async",
         lambda: svc.create_sampling_client_async(model_path=w.sampler)))  # fmt: skip
    add(("ServiceClient.create_training_client_from_state",
         lambda: svc.create_training_client_from_state(w.state)))  # fmt: skip
    add(("ServiceClient.create_training_client_from_state_async",
         lambda: svc.create_training_client_from_state_async(w.state)))  # fmt: skip
    add(("ServiceClient.create_training_client_from_state_with_optimizer",
         lambda: svc.create_training_client_from_state_with_optimizer(w.state)))  # fmt: skip
    add(("ServiceClient.create_training_client_from_state_with_optimizer_async",
         lambda: svc.create_training_client_from_state_with_optimizer_async(w.state)))  # fmt: skip
    add(("ServiceClient.copy_weights", lambda: svc.copy_weights(w.sampler)))

    # ---- the REST client ----
    run = lambda: w.state.split("/")[2]  # noqa: E731
    add(("RestClient.get_server_capabilities", rest.get_server_capabilities))
    add(("RestClient.get_telemetry", rest.get_telemetry))
    add(("RestClient.whoami", rest.whoami))
    add(("RestClient.list_training_runs", lambda: rest.list_training_runs(project_id="walk")))
    add(("RestClient.list_training_runs_async", rest.list_training_runs_async))
    add(("RestClient.get_training_run", lambda: rest.get_training_run(run())))
    add(("RestClient.get_training_run_async", lambda: rest.get_training_run_async(run())))
    add(("RestClient.get_training_run_by_tinker_path",
         lambda: rest.get_training_run_by_tinker_path(w.state)))  # fmt: skip
    add(("RestClient.get_training_run_by_tinker_path_async",
         lambda: rest.get_training_run_by_tinker_path_async(w.state)))  # fmt: skip
    add(("RestClient.get_weights_info_by_tinker_path",
         lambda: rest.get_weights_info_by_tinker_path(w.state)))  # fmt: skip
    add(("RestClient.list_checkpoints", lambda: rest.list_checkpoints(run())))
    add(("RestClient.list_checkpoints_async", lambda: rest.list_checkpoints_async(run())))
    add(("RestClient.list_user_checkpoints", rest.list_user_checkpoints))
    add(("RestClient.list_user_checkpoints_async", rest.list_user_checkpoints_async))

    def external_urls() -> Any:
        urls = done(rest.get_external_weights_urls(w.external))
        first = next(iter(urls.urls.values()))
        assert httpx.get(first, timeout=WAIT).status_code == 200
        return urls

    add(("RestClient.get_external_weights_urls", external_urls))
    add(("RestClient.get_external_weights_urls_async",
         lambda: rest.get_external_weights_urls_async(w.external)))  # fmt: skip
    add(("RestClient.set_checkpoint_ttl_from_tinker_path",
         lambda: rest.set_checkpoint_ttl_from_tinker_path(w.sampler, 86400)))  # fmt: skip
    add(("RestClient.set_checkpoint_ttl_from_tinker_path_async",
         lambda: rest.set_checkpoint_ttl_from_tinker_path_async(w.sampler, None)))  # fmt: skip
    add(("RestClient.publish_checkpoint_from_tinker_path",
         lambda: rest.publish_checkpoint_from_tinker_path(w.sampler)))  # fmt: skip
    add(("RestClient.publish_checkpoint_from_tinker_path_async",
         lambda: rest.publish_checkpoint_from_tinker_path_async(w.sampler)))  # fmt: skip
    add(("RestClient.unpublish_checkpoint_from_tinker_path",
         lambda: rest.unpublish_checkpoint_from_tinker_path(w.sampler)))  # fmt: skip
    add(("RestClient.unpublish_checkpoint_from_tinker_path_async",
         lambda: rest.unpublish_checkpoint_from_tinker_path_async(w.sampler)))  # fmt: skip
    add(("RestClient.copy_weights", lambda: rest.copy_weights(w.sampler, "walk-archive")))
    add(("RestClient.copy_weights_async",
         lambda: rest.copy_weights_async(w.sampler, "walk-archive")))  # fmt: skip
    add(("RestClient.list_sessions", rest.list_sessions))
    add(("RestClient.list_sessions_async", rest.list_sessions_async))
    add(("RestClient.get_session", lambda: rest.get_session(w.session_id())))
    add(("RestClient.get_session_async", lambda: rest.get_session_async(w.session_id())))

    def get_sampler() -> Any:
        ids = done(rest.get_session(w.session_id())).sampler_ids
        return rest.get_sampler(ids[0])

    def get_sampler_async() -> Any:
        ids = done(rest.get_session(w.session_id())).sampler_ids
        return rest.get_sampler_async(ids[-1])

    add(("RestClient.get_sampler", get_sampler))
    add(("RestClient.get_sampler_async", get_sampler_async))
    add(("RestClient.search_sessions",
         lambda: rest.search_sessions(T.SessionSearchRequest(project_ids=["walk"]))))  # fmt: skip
    add(("RestClient.assign_session_project",
         lambda: rest.assign_session_project(w.session_id(), "walk-2")))  # fmt: skip
    add(("RestClient.assign_session_project_async",
         lambda: rest.assign_session_project_async(w.session_id(), "walk")))  # fmt: skip

    def trace() -> Any:
        url = done(rest.export_session_trace(w.session_id()))
        got = httpx.get(url, timeout=WAIT)
        assert got.status_code == 200 and got.json()["traceEvents"]
        return url

    add(("RestClient.export_session_trace", trace))
    add(("RestClient.export_session_trace_async",
         lambda: rest.export_session_trace_async(w.session_id())))  # fmt: skip
    add(("RestClient.get_billing_usage", lambda: rest.get_billing_usage(now - hour, now + hour)))
    add(("RestClient.get_billing_usage_async",
         lambda: rest.get_billing_usage_async(now - hour, now + hour)))  # fmt: skip
    add(("RestClient.get_current_checkpoint_storage_usage",
         rest.get_current_checkpoint_storage_usage))  # fmt: skip
    add(("RestClient.get_current_checkpoint_storage_usage_async",
         rest.get_current_checkpoint_storage_usage_async))  # fmt: skip
    add(("RestClient.get_audit_log", rest.get_audit_log))
    add(("RestClient.get_audit_log_async", rest.get_audit_log_async))
    add(("RestClient.delete_checkpoint",
         lambda: rest.delete_checkpoint(run(), "weights/walk-state-2")))  # fmt: skip
    add(("RestClient.delete_checkpoint_async",
         lambda: rest.delete_checkpoint_async(run(), "sampler_weights/walk-sampler-2")))  # fmt: skip
    add(("RestClient.delete_checkpoint_from_tinker_path",
         lambda: rest.delete_checkpoint_from_tinker_path(w.external)))  # fmt: skip
    add(("RestClient.delete_checkpoint_from_tinker_path_async",
         lambda: rest.delete_checkpoint_from_tinker_path_async(
             w.external.replace("walk-external", "walk-external-2"))))  # fmt: skip
    add(("ServiceClient.close", lambda: svc.close("success")))
    return s


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("sdk-surface")
    keys = make_tenants(data, {"walker": None})
    config = {"jwt_auth": True, "metrics_networks": "127.0.0.1/32"}
    srv = start_server({TINY: tiny_model_dir}, data, config, process=True)  # treadle serve
    srv.keys = keys
    yield srv
    srv.stop()


def answered(url: str) -> dict[str, set[str]]:
    """Route → the statuses the server answered it with (its own request counter)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    seen: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = re.match(r"treadle_http_requests_total\{(.*)\} ([0-9.e+]+)$", line)
        if m and float(m.group(2)) > 0:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            seen.setdefault(f"{labels['method']} {labels['route']}", set()).add(labels["status"])
    return seen


# Routes of the SDK's optional protocols that the walk must have made it use.
OPTIONAL_ROUTES = {
    "POST /api/v1/auth/token",  # jwt_auth: the key exchanged for a token
    "POST /api/v1/create_custom_loss",  # the loss runs on the server
    "POST /api/v1/retrieve_futures",  # samplers poll together
    "POST /api/v1/join_sampling_session",  # from_sampler_handle
    "POST /api/v1/copy_weights",
    "POST /api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish",
    "GET /api/v1/sessions/{session_id}/trace_export",
    "GET /api/v1/billing/usage/events",
    "GET /api/v1/audit",
}


def test_every_public_method_of_the_sdk_against_a_real_server(server):
    w = Walk(server.url, server.keys["walker"])
    planned = steps(w)
    names = [n for n, _ in planned]
    assert len(names) == len(set(names)), "a method walked twice"
    known = set(names) | set(NOT_APPLICABLE)
    assert public_methods() - known == set(), "methods of the SDK this walk does not call"
    assert known - public_methods() == set(), "methods the SDK no longer has"
    errors = []
    for name, call in planned:
        try:
            done(call())
        except Exception as e:  # noqa: BLE001 - every failure is listed, then the test fails
            errors.append(f"{name}: {type(e).__name__}: {e}")
    assert not errors, "\n".join(errors)
    seen = answered(server.url)
    failed = {route: sorted(s) for route, s in seen.items() if "404" in s or any(
        code.startswith("5") for code in s)}  # fmt: skip
    assert failed == {}, failed
    assert OPTIONAL_ROUTES <= {r for r, s in seen.items() if "200" in s}, sorted(seen)
    who = done(w.rest.whoami())
    assert who.org_urn.endswith(":" + who.user_urn.rsplit(":", 1)[-1])
    pickle.loads(pickle.dumps(w.sc))  # a sampling client still pickles after all that
