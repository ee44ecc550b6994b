"""TrainingClient: one LoRA adapter on the server, driven by ordered, asynchronous calls.

    fb = tc.forward_backward(datums, loss_fn="ppo")
    op = tc.optim_step(AdamParams(learning_rate=1e-5))   # sent before fb completes
    fb.result(); op.result()

Every call returns an APIFuture at once. Calls get seq_ids 1, 2, ... in call order (the
model's creation was 0) and are sent in that order by a background submitter; the server runs
them in seq_id order, so a loop may queue several before waiting on any.

The checkpoint calls (save/load state, sampler weights, sampling clients) are in
training_checkpoints.py, the local half of forward_backward_custom in custom_loss.py.
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
from treadle.client.custom_loss import CustomLossFn, _ce_datum, _custom_weights, _zero_weights
from treadle.client.futures import APIFuture
from treadle.client.submitter import Job, OrderedSubmitter, Submission
from treadle.client.tokenizer import load_tokenizer
from treadle.client.training_checkpoints import CheckpointCalls
from treadle.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    OptimStepResponse,
)
from treadle.wire import codec
from treadle.wire import requests as rq

if TYPE_CHECKING:
    from treadle.client.service import ServiceClient

log = logging.getLogger("treadle.client")


def _as_data(data: Sequence[Datum | dict]) -> list[Datum]:
    if not data:
        raise ValueError("data: expected at least one Datum, got an empty list")
    return [d if isinstance(d, Datum) else Datum.model_validate(d) for d in data]


class TrainingClient(CheckpointCalls):
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
