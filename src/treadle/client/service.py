"""ServiceClient: the entry point of the SDK; one server session, many training clients.

    from treadle import ServiceClient
    svc = ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-...")
    tc = svc.create_lora_training_client("treadle/tiny-llama", rank=32, alpha=64)

The session (`create_session`, a heartbeat every 10 s, `sessions/{id}/finish`) is opened on
the first create call and finished by `close()`, by the context manager, or when the last
training client of this ServiceClient is stopped.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from treadle.client import excepthook, hints
from treadle.client.capture import CaptureSession, create_capture_session
from treadle.client.checkpoints import CheckpointsClient
from treadle.client.errors import APIError, NotFoundError
from treadle.client.estimate import CostEstimate, RunPlan, price
from treadle.client.porting import ported_target
from treadle.client.sampling import SamplingClient
from treadle.client.saved_checkpoints import SavedCheckpoints
from treadle.client.session import ServerSession
from treadle.client.tokenizer import load_tokenizer
from treadle.client.training import TrainingClient
from treadle.client.transport import SDK_VERSION, RetryPolicy, Transport
from treadle.types import TRAINING_SESSION_NAME, GetInfoResponse, LoraConfig, SupportedModel
from treadle.wire import requests as rq

log = logging.getLogger("treadle.client")

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
ENCRYPTION_HEADER = "X-Treadle-Encryption-Key"

_open_clients: weakref.WeakSet[ServiceClient] = weakref.WeakSet()


class ServiceClient:
    """Connects to a Treadle (or any Tinker-protocol) server and creates clients.

    `base_url` and `api_key` default to TREADLE_BASE_URL / TREADLE_API_KEY (then the TINKER_
    variables, so one environment serves both SDKs).
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        user_metadata: dict[str, str] | None = None,
        project_id: str | None = None,
        display_name: str | None = None,
        retry: RetryPolicy | None = None,
        timeout_s: float = 120.0,
        model_package_group: str | None = None,
        output_path: str | None = None,
        encryption_key: str | None = None,
        model_package_group_arn: str | None = None,
        s3_output_path: str | None = None,
        **managed_service_args: Any,
    ):
        """`model_package_group` / `output_path`: defaults for the training clients made
        here (their saves become versions of that group, stored under output_path: an
        s3://bucket/prefix or a server folder). `encryption_key`: a 32-byte AES key (base64
        or hex; see treadle.artifacts.encryption.new_key) sent with every request, never stored
        by the server: versions are stored encrypted with it and read back only with it.

        The managed service's names are accepted too (treadle.client.porting):
        `model_package_group_arn` (its last path element is the group) and `s3_output_path`;
        its infrastructure settings (role_arn, region, vpc_config, ...) raise TypeError."""
        model_package_group, output_path = ported_target(
            "ServiceClient()",
            model_package_group,
            output_path,
            model_package_group_arn,
            s3_output_path,
            managed_service_args,
        )
        base_url = (
            base_url
            or os.environ.get("TREADLE_BASE_URL")
            or os.environ.get("TINKER_BASE_URL")
            or DEFAULT_BASE_URL
        )
        api_key = api_key or os.environ.get("TREADLE_API_KEY") or os.environ.get("TINKER_API_KEY")
        excepthook.install()  # a newcomer's mistake, uncaught, ends the script in one line
        self.transport = Transport(base_url, api_key, retry=retry, timeout_s=timeout_s)
        try:
            self.client_config: dict[str, Any] = self.transport.call(
                # a wrong URL should fail in seconds, not after the full retry deadline
                self.transport.post(
                    "/api/v1/client/config",
                    rq.ClientConfigRequest(sdk_version=SDK_VERSION),
                    deadline_s=min(self.transport.retry.deadline_s, 10.0),
                )
            )
        except APIError as e:
            self.transport.close()
            raise hints.reaching(e, base_url) from None
        except BaseException:
            self.transport.close()
            raise
        self._session = ServerSession(self.transport, user_metadata, project_id, display_name)
        self._lock = threading.Lock()
        self._training_clients: set[TrainingClient] = set()
        self._closed = False
        self.model_package_group = model_package_group
        self.output_path = output_path
        if encryption_key:
            self.transport.headers[ENCRYPTION_HEADER] = encryption_key
        self.checkpoints = CheckpointsClient(self.transport)
        self.saved = SavedCheckpoints(self.transport)  # tinker:// checkpoints: search, TTL
        _open_clients.add(self)

    # ---- session ---------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        """The server session, created on first use."""
        return self._live().id

    def _next_model_seq_id(self) -> tuple[str, int]:
        return self._live().next_model_seq_id()

    def next_sampling_seq_id(self) -> tuple[str, int]:
        """create_sampling_session and snapshot saves share one counter per session."""
        return self._live().next_sampling_seq_id()

    def _live(self) -> ServerSession:
        if self._closed:
            raise RuntimeError("this ServiceClient is closed")
        return self._session

    def _finish_session(self, reason: str = "success") -> None:
        self._session.finish(reason)

    def _release(self, client: TrainingClient) -> None:
        """Called by TrainingClient.stop(): the last one out finishes the session."""
        with self._lock:
            self._training_clients.discard(client)
            last = not self._training_clients
        if last:
            self._finish_session()

    def close(self, reason: str = "success") -> None:
        """Stop every training client, finish the session and close connections."""
        if self._closed:
            return
        for client in list(self._training_clients):
            client.stop(_finish_session=False)
        self._finish_session(reason)
        self._closed = True
        self.transport.close()
        _open_clients.discard(self)

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("success" if exc_type is None else "errored")

    # ---- models ----------------------------------------------------------------------

    def get_server_capabilities(self) -> rq.GetServerCapabilitiesResponse:
        reply = self.transport.call(self.transport.get("/api/v1/get_server_capabilities"))
        return rq.GetServerCapabilitiesResponse.model_validate(reply)

    def list_base_models(self) -> list[SupportedModel]:
        """The base models the server serves (use `.model_name` as `base_model`)."""
        return self.get_server_capabilities().supported_models

    def get_tokenizer(self, base_model: str) -> Any:
        """The base model's tokenizer, fetched from the server (never from a hub)."""
        return load_tokenizer(self.transport, base_model)

    def create_capture_session(self, capture_id: str | None = None) -> CaptureSession:
        """A capture session (treadle.client.capture): completions served with its headers
        on /v1 or /v1/messages are recorded token-exactly, for rewards and datums.
        `capture_id`: a name of your own (an existing capture of that name is reused)."""
        return create_capture_session(self.transport, capture_id)

    def get_usage(self, since: str | None = None, by: str | None = None) -> dict[str, Any]:
        """This key's tenant's metered tokens (prefill / sample / train) and their cost:
        totals, or rows `by` "session", "day" or "model"; `since` a date or ISO time (UTC)."""
        params = {k: v for k, v in (("since", since), ("by", by)) if v is not None}
        path = "/api/v1/treadle/usage" + (f"?{urlencode(params)}" if params else "")
        return self.transport.call(self.transport.get(path))

    def get_prices(self) -> dict[str, dict[str, float] | None]:
        """The server's price table: per served model, $ per million prefill / sample /
        train tokens (None: the model is not charged)."""
        return self.transport.call(self.transport.get("/api/v1/treadle/prices"))["prices"]

    def estimate_cost(self, plan: RunPlan) -> CostEstimate:
        """A run's tokens (a RunPlan: treadle.client.estimate, or the cookbook's plan of a
        recipe) priced with the server's table: low, expected and high cost."""
        prices = self.get_prices()
        if plan.model not in prices:
            raise NotFoundError(
                f"model {plan.model!r} is not served here; served: {sorted(prices)}"
            )
        return price(plan, prices[plan.model])

    # ---- training clients ----------------------------------------------------------------

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
        *,
        alpha: float | None = None,
        training_session_name: str | None = None,
        model_package_group: str | None = None,
        output_path: str | None = None,
        model_package_group_arn: str | None = None,
        s3_output_path: str | None = None,
        **managed_service_args: Any,
    ) -> TrainingClient:
        """A new LoRA adapter on `base_model`; `alpha` defaults to 32 on the server.

        With a `model_package_group` (default: the ServiceClient's), every save of this
        client registers a version of that group, stored under `output_path`. The managed
        service's `model_package_group_arn` and `s3_output_path` mean the same
        (treadle.client.porting)."""
        model_package_group, output_path = ported_target(
            "create_lora_training_client()",
            model_package_group,
            output_path,
            model_package_group_arn,
            s3_output_path,
            managed_service_args,
        )
        if not (train_mlp or train_attn or train_unembed):
            raise ValueError("train_mlp, train_attn, train_unembed: at least one must be True")
        if training_session_name is not None:
            # the session's name: sent with the session if this call opens it, and with the
            # model, whose first name names a session opened without one (server side)
            self._session.name_if_unnamed(training_session_name)
            user_metadata = {**(user_metadata or {}), TRAINING_SESSION_NAME: training_session_name}
        session_id, model_seq_id = self._next_model_seq_id()
        body = rq.CreateModelRequest(
            session_id=session_id,
            model_seq_id=model_seq_id,
            base_model=base_model,
            user_metadata=user_metadata,
            lora_config=LoraConfig(
                rank=rank,
                seed=seed,
                train_mlp=train_mlp,
                train_attn=train_attn,
                train_unembed=train_unembed,
                alpha=alpha,
            ),
            model_package_group=model_package_group or self.model_package_group,
            output_path=output_path or self.output_path,
        )
        try:
            reply = self._run_future("/api/v1/create_model", body, "CreateModel")
        except APIError as e:
            raise hints.model_choice(e) from None
        return self._attach(str(reply["model_id"]))

    def create_training_client_from_state(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        *,
        model_package_group: str | None = None,
        output_path: str | None = None,
    ) -> TrainingClient:
        """A new training client with the weights of a checkpoint, fresh Adam.

        `path`: a tinker:// checkpoint, a version `GROUP:N` / `GROUP:latest` (of any
        group: import from another group), or a local PEFT adapter folder (imported first
        as a version of model_package_group, or of "imports")."""
        if not path.startswith("tinker://") and Path(path).is_dir():
            group = model_package_group or self.model_package_group or "imports"
            path = self.checkpoints.import_adapter(path, group, base_model=base_model).ref
        return self._create_via_load(
            path, base_model, user_metadata, False, model_package_group, output_path
        )

    def create_training_client_from_state_with_optimizer(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        *,
        model_package_group: str | None = None,
        output_path: str | None = None,
    ) -> TrainingClient:
        """As create_training_client_from_state, plus the checkpoint's Adam state; `path`
        is a tinker://.../weights/... checkpoint or a state version (`GROUP:latest` is the
        group's newest state)."""
        return self._create_via_load(
            path, base_model, user_metadata, True, model_package_group, output_path
        )

    def _create_via_load(
        self,
        path: str,
        base_model: str | None,
        user_metadata: dict[str, str] | None,
        optimizer: bool,
        model_package_group: str | None = None,
        output_path: str | None = None,
    ) -> TrainingClient:
        session_id, model_seq_id = self._next_model_seq_id()
        body = rq.LoadWeightsRequest(
            session_id=session_id,
            model_seq_id=model_seq_id,
            base_model=base_model,
            user_metadata=user_metadata,
            path=path,
            optimizer=optimizer,
            model_package_group=model_package_group or self.model_package_group,
            output_path=output_path or self.output_path,
        )
        self._run_future("/api/v1/load_weights", body, "LoadWeights")
        # The protocol fixes the id of a model created by loading.
        return self._attach(f"{session_id}:train:{model_seq_id}")

    def _run_future(self, path: str, body: Any, request_type: str) -> dict:
        async def _go() -> dict:
            reply = await self.transport.post(path, body)
            result = await self.transport.wait_result(str(reply["request_id"]), request_type)
            assert isinstance(result, dict), f"{request_type}: expected a JSON result"
            return result

        return self.transport.call(_go())

    def _attach(self, model_id: str) -> TrainingClient:
        reply = self.transport.call(
            self.transport.post("/api/v1/get_info", rq.GetInfoRequest(model_id=model_id))
        )
        client = TrainingClient(self, model_id, GetInfoResponse.model_validate(reply))
        with self._lock:
            self._training_clients.add(client)
        return client

    # ---- sampling clients ----------------------------------------------------------------

    def create_sampling_client(
        self,
        model_path: str | None = None,
        base_model: str | None = None,
        record_stability_info: bool = False,
    ) -> SamplingClient:
        """Sample from saved sampler weights (`tinker://.../sampler_weights/...`, or a
        model package version `GROUP:N` / `GROUP:latest`) or a base.

        `record_stability_info`: the server keeps every sequence this client samples, for a
        day, under its `sequence_id`, so that this session's training requests can name it
        in their provenance (what `stable_reinforce` trains on)."""
        if model_path is None and base_model is None:
            raise ValueError("create_sampling_client: give model_path or base_model")
        # a version reference is resolved (fetched, decrypted) by the server
        session_id, seq = self.next_sampling_seq_id()
        body = rq.CreateSamplingSessionRequest(
            session_id=session_id,
            sampling_session_seq_id=seq,
            model_path=model_path,
            base_model=base_model,
        )
        try:
            reply = self.transport.call(
                self.transport.post("/api/v1/create_sampling_session", body)
            )
        except APIError as e:
            raise hints.model_choice(e) from None
        return SamplingClient(
            self.transport,
            str(reply["sampling_session_id"]),
            base_model,
            record_stability_info=record_stability_info,
        )

    def unload_model(self, model_id: str) -> None:
        """Free a model's adapter on the server; a server without the route is tolerated."""
        try:
            self._run_future(
                "/api/v1/unload_model", rq.UnloadModelRequest(model_id=model_id), "UnloadModel"
            )
        except NotFoundError:
            pass


@atexit.register
def _close_all() -> None:
    # Finish sessions at exit, so the server frees adapters now rather than at its timeout.
    for client in list(_open_clients):
        try:
            client.close()
        except Exception:  # noqa: BLE001 - best effort while the interpreter exits
            pass
