"""SamplingClient: generation and scoring with one set of weights (a snapshot, saved sampler
weights or a base model).

    futs = [sc.sample(tok.encode(q), num_samples=8, sampling_params=params) for q in qs]
    results = [f.result() for f in futs]      # all were in flight before the first wait

Samples need no ordering: each call is sent at once from the background loop with its own
`seq_id`, which the server uses to recognise a retried submit.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections.abc import Sequence
from typing import Any

from treadle.client.errors import GoneError
from treadle.client.futures import APIFuture
from treadle.client.tokenizer import load_tokenizer
from treadle.client.transport import Transport
from treadle.types import (
    ModelInput,
    SampleResponse,
    SamplingParams,
    as_model_input,
    to_tensor_data,
)
from treadle.wire import codec
from treadle.wire import requests as rq

# A result the server let expire (HTTP 410) is asked for again under a new seq_id.
MAX_RESUBMITS = 3
# An unpickled copy numbers its samples from CLONE_BLOCK * (random clone id), as the tinker
# SDK does, so that copies in other processes never reuse the original's seq_ids.
CLONE_BLOCK = 1_000_000_000

_clone_transports: dict[tuple[str, str | None], Transport] = {}
_clone_lock = threading.Lock()


class SamplingClient:
    def __init__(
        self,
        transport: Transport,
        sampling_session_id: str,
        base_model: str | None,
        first_seq_id: int = 0,
        *,
        record_stability_info: bool = False,
    ):
        """`record_stability_info`: every sample is kept by the server under its
        sequence_id (for this session's training requests to name in their provenance)."""
        self._transport = transport
        self.sampling_session_id = sampling_session_id
        self._base_model = base_model
        self.record_stability_info = record_stability_info
        self._seq = itertools.count(first_seq_id)
        self._seq_lock = threading.Lock()

    def __reduce__(self) -> tuple:
        """Picklable (e.g. for worker processes): the copy opens its own connection pool and
        samples under the same sampling session, which the original's session keeps alive."""
        t = self._transport
        args = (t.base_url, t.api_key, self.sampling_session_id, self._base_model)
        return (_unpickle, (*args, self.record_stability_info))

    def __repr__(self) -> str:
        return f"SamplingClient(sampling_session_id={self.sampling_session_id!r})"

    def _next_seq_id(self) -> int:
        with self._seq_lock:
            return next(self._seq)

    def sample(
        self,
        prompt: ModelInput | Sequence[int],
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: Any = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[SampleResponse]:
        """`num_samples` continuations of `prompt` (token ids or a ModelInput).

        include_prompt_logprobs / topk_prompt_logprobs=K: each prompt token's logprob / the top
        K at each prompt position (only the last `prompt_logprobs_last_n` when set);
        topk_sample_logprobs=K: the top K at each sampled position; target_prompt_logprobs:
        (len(prompt) - 1, K) token ids (TensorData, numpy or torch; -1 = none) whose logprobs
        to return, row i at prompt position i + 1; prompt_alt_tokens_k=K: K draws at the
        sampling temperature from each prompt position's next-token distribution.
        """
        if num_samples < 1:
            raise ValueError(f"num_samples: expected >= 1, got {num_samples}")
        target = None
        if target_prompt_logprobs is not None:
            target = to_tensor_data("target_tokens", target_prompt_logprobs).model_dump()
        body = rq.SampleRequest(
            num_samples=num_samples,
            prompt=as_model_input(prompt),
            sampling_params=sampling_params or SamplingParams(),
            sampling_session_id=self.sampling_session_id,
            prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
            target_prompt_logprobs=target,
            prompt_alt_tokens_k=prompt_alt_tokens_k,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
            record_stability_info=self.record_stability_info or None,
        ).model_dump(mode="json", exclude_none=True)
        body["seq_id"] = self._next_seq_id()
        rids: list[str] = []  # the server's request ids, once filed: what cancel names
        future = self._transport.submit(self._sample(body, rids))
        return APIFuture(future, on_cancel=lambda: self._cancel(rids))

    def _cancel(self, rids: list[str]) -> None:
        t = self._transport
        for rid in rids:  # fire and forget: the future ends cancelled at once
            t.submit(t.post("/api/v1/cancel_future", {"request_id": rid}))

    async def _sample(self, body: dict, rids: list[str]) -> SampleResponse:
        async with self._transport.sample_slots:
            return await self._sample_once(body, rids)

    async def _sample_once(self, body: dict, rids: list[str]) -> SampleResponse:
        for attempt in range(MAX_RESUBMITS + 1):
            reply = await self._transport.post(
                "/api/v1/asample", body, headers={"X-Tinker-Sampling-Backpressure": "1"}
            )
            rids.append(str(reply["request_id"]))
            try:
                raw = await self._transport.wait_result(str(reply["request_id"]), "Sample")
            except GoneError:
                if attempt == MAX_RESUBMITS:
                    raise
                body = {**body, "seq_id": self._next_seq_id()}
                continue
            if not isinstance(raw, bytes):
                raise RuntimeError(f"asample: expected a protobuf result, got {raw!r:.200}")
            resp = codec.decode_sample_response(raw)
            ids = reply.get("sample_sequence_ids") or []
            if len(ids) == len(resp.sequences):
                for seq, seq_id in zip(resp.sequences, ids, strict=True):
                    seq.sequence_id = seq_id
            return resp
        raise AssertionError("unreachable")

    def compute_logprobs(
        self, prompt: ModelInput | Sequence[int], prompt_logprobs_last_n: int | None = None
    ) -> APIFuture[list[float | None]]:
        """log p(token_i | tokens_<i) for every prompt token (or the last N); the rest None."""
        fut = self.sample(
            prompt,
            1,
            SamplingParams(max_tokens=1),
            include_prompt_logprobs=True,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
        )
        return fut.map(lambda r: list(r.prompt_logprobs or []))

    def get_base_model(self) -> str:
        if self._base_model is None:
            reply = self._transport.call(
                self._transport.get(f"/api/v1/samplers/{self.sampling_session_id}")
            )
            self._base_model = rq.GetSamplerResponse.model_validate(reply).base_model
        return self._base_model

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer, fetched from the server and cached locally."""
        return load_tokenizer(self._transport, self.get_base_model())


def _unpickle(
    base_url: str,
    api_key: str | None,
    sampling_session_id: str,
    base_model: str | None,
    record_stability_info: bool = False,
) -> SamplingClient:
    with _clone_lock:
        transport = _clone_transports.get((base_url, api_key))
        if transport is None:
            transport = _clone_transports[(base_url, api_key)] = Transport(base_url, api_key)
    clone_id = secrets.randbelow(CLONE_BLOCK - 1) + 1
    return SamplingClient(
        transport,
        sampling_session_id,
        base_model,
        CLONE_BLOCK * clone_id,
        record_stability_info=record_stability_info,
    )
