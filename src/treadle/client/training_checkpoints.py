"""TrainingClient's checkpoint calls: save and load state, sampler weights, sampling clients.

Each is one JSON op queued in seq_id order like any training op (TrainingClient._json_op);
saves without a name get "step-<optim steps so far>", unique among the client's saves of
that kind. CheckpointCalls is a base of TrainingClient (treadle.client.training), which
provides the attributes annotated below.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from treadle.client.futures import APIFuture
from treadle.client.sampling import SamplingClient
from treadle.types import (
    LoadWeightsResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)
from treadle.wire import requests as rq

if TYPE_CHECKING:
    from treadle.client.service import ServiceClient
    from treadle.client.transport import Transport


class CheckpointCalls:
    """The checkpoint methods of TrainingClient."""

    # set by TrainingClient
    model_id: str
    base_model: str
    _service: ServiceClient
    _transport: Transport
    _steps: int
    _names: dict[str, set[str]]
    _names_lock: threading.Lock
    _json_op: Callable[..., APIFuture]

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
