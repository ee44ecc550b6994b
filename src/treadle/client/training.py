"""TrainingClient: one LoRA adapter on the server, driven by ordered, asynchronous calls.

    fb = tc.forward_backward(datums, loss_fn="ppo")
    op = tc.optim_step(AdamParams(learning_rate=1e-5))   # sent before fb completes
    fb.result(); op.result()

Every call returns an APIFuture at once. Calls get seq_ids 1, 2, ... in call order (the
model's creation was 0) and are sent in that order by a background submitter; the server runs
them in seq_id order, so a loop may queue several before waiting on any.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from treadle.client.chunks import MAX_CHUNK_BYTES, MAX_CHUNK_LEN, combine_outputs, split_chunks
from treadle.client.futures import APIFuture
from treadle.client.sampling import SamplingClient
from treadle.client.submitter import Job, OrderedSubmitter, Submission
from treadle.client.tokenizer import load_tokenizer
from treadle.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)
from treadle.wire import codec
from treadle.wire import requests as rq

if TYPE_CHECKING:
    from treadle.client.service import ServiceClient

log = logging.getLogger("treadle.client")

# fn(data, logprobs_list) -> (loss, metrics); logprobs_list[i] is a torch tensor shaped like
# data[i]'s target_tokens.
CustomLossFn = Callable[[list[Datum], list[Any]], tuple[Any, dict[str, float]]]


def _as_data(data: Sequence[Datum | dict]) -> list[Datum]:
    if not data:
        raise ValueError("data: expected at least one Datum, got an empty list")
    return [d if isinstance(d, Datum) else Datum.model_validate(d) for d in data]


class TrainingClient:
    def __init__(self, service: ServiceClient, model_id: str, info: GetInfoResponse):
        self._service = service
        self._transport = service.transport
        self.model_id = model_id
        self._info = info
        self._submitter = OrderedSubmitter(self._transport, first_seq_id=1)
        cfg = service.client_config
        self._chunk_len = int(cfg.get("fwdbwd_max_chunk_len", MAX_CHUNK_LEN))
        self._chunk_bytes = int(cfg.get("fwdbwd_max_chunk_bytes_count", MAX_CHUNK_BYTES))
        self._stopped = False
        self._steps = 0  # optim_steps queued by this client: default checkpoint names
        self._names: dict[str, set[str]] = {"state": set(), "sampler": set()}
        self._names_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"TrainingClient(model_id={self.model_id!r})"

    # ---- info ----------------------------------------------------------------------------

    def get_info(self) -> GetInfoResponse:
        """Fetched once at creation; no request."""
        return self._info

    @property
    def base_model(self) -> str:
        return self._info.model_data.model_name or self._info.model_name or ""

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer, fetched from the server and cached locally."""
        return load_tokenizer(self._transport, self.base_model)

    # ---- queueing ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._stopped:
            raise RuntimeError(f"{self!r} is stopped")

    def _json_op(
        self, path: str, request_type: str, make_body: Callable[[int], Any], parse: Callable
    ) -> APIFuture:
        """One JSON op with the next seq_id."""
        self._check_open()

        def make_job(ids: range) -> Job:
            sub = Submission(path, make_body(ids[0]), request_type)
            return _ready_job([sub], lambda raw: parse(raw[0]))

        return self._submitter.enqueue(1, make_job)

    def _fwd_bwd_subs(
        self,
        chunks: list[list[Datum]],
        ids: range,
        loss_fn: str,
        config: Mapping[str, float | str] | None,
        forward_only: bool,
    ) -> list[Submission]:
        request_type = "Forward" if forward_only else "ForwardBackward"
        return [
            Submission(
                "/api/v1/forward_backward",
                codec.encode_forward_backward_request(
                    self.model_id, seq_id, chunk, loss_fn, dict(config or {}), forward_only
                ),
                request_type,
            )
            for seq_id, chunk in zip(ids, chunks, strict=True)
        ]

    def _fwd_bwd(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None,
        forward_only: bool,
    ) -> APIFuture[ForwardBackwardOutput]:
        self._check_open()
        chunks = split_chunks(_as_data(data), self._chunk_len, self._chunk_bytes)

        def make_job(ids: range) -> Job:
            subs = self._fwd_bwd_subs(chunks, ids, loss_fn, loss_fn_config, forward_only)
            return _ready_job(subs, _decode_outputs)

        return self._submitter.enqueue(len(chunks), make_job)

    # ---- training ops --------------------------------------------------------------------

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float | str] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Logprobs and loss without gradients."""
        return self._fwd_bwd(data, loss_fn, loss_fn_config, forward_only=True)

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float | str] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Logprobs, loss and gradients (accumulated on the server until optim_step)."""
        return self._fwd_bwd(data, loss_fn, loss_fn_config, forward_only=False)

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        """A loss written in torch on this machine, as a function of per-datum logprobs.

        Two server calls: a forward for the logprobs, then a cross-entropy backward with
        weights = -dL/dlogprobs, whose gradient equals the custom loss's. Metrics carry the
        custom loss as `loss:sum` and the server's surrogate as `surrogate_loss:sum`.
        """
        self._check_open()
        data = _as_data(data)
        forward_data = [_ce_datum(d, _zero_weights(d)) for d in data]
        chunks = split_chunks(forward_data, self._chunk_len, self._chunk_bytes)
        with self._submitter.lock:  # both halves get adjacent seq_ids
            fwd = self._submitter.enqueue(
                len(chunks),
                lambda ids: _ready_job(
                    self._fwd_bwd_subs(chunks, ids, "cross_entropy", None, True), _decode_outputs
                ),
            )
            return self._submitter.enqueue(
                len(chunks), lambda ids: self._custom_backward_job(data, loss_fn, fwd, chunks, ids)
            )

    def _custom_backward_job(
        self,
        data: list[Datum],
        loss_fn: CustomLossFn,
        fwd: APIFuture[ForwardBackwardOutput],
        chunks: list[list[Datum]],
        ids: range,
    ) -> Job:
        state: dict[str, Any] = {}

        async def build() -> list[Submission]:
            try:
                fwd_out = await asyncio.wrap_future(fwd.future())
                loop = asyncio.get_running_loop()
                weighted, loss_sum, metrics = await loop.run_in_executor(
                    None, _custom_weights, data, loss_fn, fwd_out
                )
            except BaseException as exc:  # noqa: BLE001 - re-raised by finish
                # The reserved seq_ids must still reach the server: send the forward again.
                state["error"] = exc
                return self._fwd_bwd_subs(chunks, ids, "cross_entropy", None, True)
            state["loss_sum"], state["metrics"] = loss_sum, metrics
            sizes = [len(c) for c in chunks]
            bounds = np.cumsum([0, *sizes])
            backward_chunks = [weighted[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            return self._fwd_bwd_subs(backward_chunks, ids, "cross_entropy", None, False)

        def finish(raw: list[bytes | dict]) -> ForwardBackwardOutput:
            if "error" in state:
                raise state["error"]
            out = _decode_outputs(raw)
            metrics = dict(out.metrics)
            surrogate = metrics.pop("loss:sum", None)
            metrics.update(state["metrics"])
            metrics["loss:sum"] = state["loss_sum"]
            if surrogate is not None:
                metrics["surrogate_loss:sum"] = surrogate
            return out.model_copy(update={"metrics": metrics})

        return Job(build, finish)

    def optim_step(
        self, optim_params: AdamParams | None = None, *, adam_params: AdamParams | None = None
    ) -> APIFuture[OptimStepResponse]:
        """One AdamW step on the gradients accumulated since the last step."""
        if optim_params is not None and adam_params is not None:
            raise ValueError("optim_step: give optim_params or adam_params, not both")
        params = optim_params or adam_params or AdamParams()
        with self._names_lock:
            self._steps += 1
        return self._json_op(
            "/api/v1/optim_step",
            "OptimStep",
            lambda seq: rq.OptimStepRequest(model_id=self.model_id, seq_id=seq, adam_params=params),
            OptimStepResponse.model_validate,
        )

    # ---- checkpoints ---------------------------------------------------------------------

    def _name(self, kind: str, name: str | None) -> str:
        """`name`, or a default unique among this client's saves of `kind`: "step-000012"
        after 12 optim_steps (then "step-000012-2", ... for more saves at that step)."""
        with self._names_lock:
            used = self._names[kind]
            if name is None:
                base = name = f"step-{self._steps:06d}"
                n = 1
                while name in used:
                    n += 1
                    name = f"{base}-{n}"
            used.add(name)
            return name

    def save_state(
        self,
        name: str | None = None,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveWeightsResponse]:
        """Adapter + optimizer state → `.path` = tinker://<run>/weights/<name>; without a
        name, "step-<optim steps so far>" (unique among this client's saves)."""
        name = self._name("state", name)
        return self._json_op(
            "/api/v1/save_weights",
            "SaveWeights",
            lambda seq: rq.SaveWeightsRequest(
                model_id=self.model_id,
                path=name,
                seq_id=seq,
                ttl_seconds=ttl_seconds,
                overwrite=overwrite,
                user_metadata=user_metadata,
            ),
            SaveWeightsResponse.model_validate,
        )

    def _load(self, path: str, optimizer: bool) -> APIFuture[LoadWeightsResponse]:
        return self._json_op(
            "/api/v1/load_weights",
            "LoadWeights",
            lambda seq: rq.LoadWeightsRequest(
                model_id=self.model_id, seq_id=seq, path=path, optimizer=optimizer
            ),
            LoadWeightsResponse.model_validate,
        )

    def load_state(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Replace this adapter's weights with a checkpoint's (optimizer state reset)."""
        return self._load(path, optimizer=False)

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Replace weights and Adam state with a checkpoint's."""
        return self._load(path, optimizer=True)

    def save_weights_for_sampler(
        self,
        name: str | None = None,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
        *,
        merge_weights: bool = False,
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """A durable PEFT adapter → `.path` = tinker://<run>/sampler_weights/<name>; without
        a name, "step-<optim steps so far>" (unique among this client's saves).

        `merge_weights=True` also publishes a merged, deployable HF model folder as a
        version of the client's model package group (needs one)."""
        name = self._name("sampler", name)
        return self._json_op(
            "/api/v1/save_weights_for_sampler",
            "SaveWeightsForSampler",
            lambda seq: rq.SaveWeightsForSamplerRequest(
                model_id=self.model_id,
                path=name,
                seq_id=seq,
                ttl_seconds=ttl_seconds,
                user_metadata=user_metadata,
                merge_weights=merge_weights,
            ),
            SaveWeightsForSamplerResponse.model_validate,
        )

    def save_weights_and_get_sampling_client(
        self, name: str | None = None, record_stability_info: bool = False
    ) -> SamplingClient:
        """Snapshot the current weights (in memory) and return a client sampling from them.

        Waits for the ops queued before it; `name` is accepted for compatibility and ignored.
        `record_stability_info`: as ServiceClient.create_sampling_client.
        """
        _, sampling_seq = self._service.next_sampling_seq_id()
        fut = self._json_op(
            "/api/v1/save_weights_for_sampler",
            "SaveWeightsForSampler",
            lambda seq: rq.SaveWeightsForSamplerRequest(
                model_id=self.model_id, seq_id=seq, sampling_session_seq_id=sampling_seq
            ),
            SaveWeightsForSamplerResponse.model_validate,
        )
        reply = fut.result()
        if not reply.sampling_session_id:
            raise RuntimeError(
                "save_weights_for_sampler: the server returned no sampling_session_id"
            )
        return SamplingClient(
            self._transport,
            reply.sampling_session_id,
            self.base_model,
            record_stability_info=record_stability_info,
        )

    def create_sampling_client(
        self, model_path: str | None = None, record_stability_info: bool = False
    ) -> SamplingClient:
        """Sample from saved sampler weights, or, with no path, from this session's weights
        as they are now (an in-memory snapshot on the server)."""
        if model_path is None:
            return self.save_weights_and_get_sampling_client(
                record_stability_info=record_stability_info
            )
        return self._service.create_sampling_client(
            model_path=model_path, record_stability_info=record_stability_info
        )

    # ---- metrics -------------------------------------------------------------------------

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> dict[str, Any]:
        """Report the loop's own metrics of a step (`train/reward`, `test/nll`, ...): the
        server's console draws them beside its own per-step figures. A later report of the
        same step replaces its values; non-finite numbers are skipped (named in the reply)."""
        values = {str(k): float(v) for k, v in metrics.items()}
        finite = {k: v for k, v in values.items() if math.isfinite(v)}  # JSON has no NaN
        skipped = [k for k in values if k not in finite]
        if not finite:
            return {"recorded": 0, "skipped": skipped}
        body = {"model_id": self.model_id, "step": int(step), "metrics": finite}
        reply = self._transport.call(self._transport.post("/api/v1/treadle/metrics", body))
        return {**reply, "skipped": skipped + list(reply.get("skipped", []))}

    # ---- lifecycle -----------------------------------------------------------------------

    def stop(self, timeout: float | None = None, *, _finish_session: bool = True) -> None:
        """Wait for queued ops, free the adapter on the server, and finish the session if
        this was its last training client. Checkpoints saved stay available."""
        if self._stopped:
            return
        self._stopped = True
        for fut in self._submitter.pending():
            try:
                fut.result(timeout)
            except Exception:  # noqa: BLE001 - the op's own waiter sees its error
                pass
        self._submitter.close()
        if _finish_session:
            self._service.unload_model(self.model_id)
            self._service._release(self)

    def __enter__(self) -> TrainingClient:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.stop()


# ---- helpers ---------------------------------------------------------------------------------


def _ready_job(subs: list[Submission], finish: Callable) -> Job:
    async def build() -> list[Submission]:
        return subs

    return Job(build, finish)


def _decode_outputs(raw: list[bytes | dict]) -> ForwardBackwardOutput:
    outs = []
    for item in raw:
        if not isinstance(item, bytes):
            raise RuntimeError(f"forward_backward: expected a protobuf result, got {item!r:.200}")
        outs.append(codec.decode_forward_backward_output(item))
    return combine_outputs(outs)


def _zero_weights(datum: Datum) -> np.ndarray:
    if "target_tokens" not in datum.loss_fn_inputs:
        raise ValueError("loss_fn_inputs: forward_backward_custom needs 'target_tokens'")
    return np.zeros(datum.loss_fn_inputs["target_tokens"].to_numpy().shape, dtype=np.float32)


def _ce_datum(datum: Datum, weights: np.ndarray) -> Datum:
    return Datum(
        model_input=datum.model_input,
        loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"], "weights": weights},
    )


def _custom_weights(
    data: list[Datum], loss_fn: CustomLossFn, fwd_out: ForwardBackwardOutput
) -> tuple[list[Datum], float, dict[str, float]]:
    """Run the user's loss on the forward's logprobs; weights = -dL/dlogprobs per datum.

    The server's cross-entropy is sum(-w * logprobs), so its gradient with these weights is
    exactly dL/dparams by the chain rule.
    """
    try:
        import torch
    except ImportError as exc:
        raise ImportError("forward_backward_custom needs torch (pip install torch)") from exc
    logprobs_D = [
        torch.tensor(out["logprobs"].to_numpy(), dtype=torch.float32).requires_grad_(True)
        for out in fwd_out.loss_fn_outputs
    ]
    loss, metrics = loss_fn(data, logprobs_D)
    loss.backward()
    weighted = []
    for datum, lp in zip(data, logprobs_D, strict=True):
        grad = lp.grad if lp.grad is not None else torch.zeros_like(lp)
        weighted.append(_ce_datum(datum, (-grad).numpy()))
    return weighted, float(loss.detach().sum()), {k: float(v) for k, v in metrics.items()}
