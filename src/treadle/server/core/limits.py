"""What a tenant may ask: input limits of one request (config `limits`, 400 beyond), the
tenant's quotas and spend caps (429 beyond), checked where every route's operations pass
(Futures.file and the components that make sessions and adapters), so that the Tinker routes
and the OpenAI-compatible ones are held to the same limits."""

from __future__ import annotations

from treadle.errors import InvalidRequestError
from treadle.protocol.ops import METERED_KINDS, OpKind, Payload, Sample, TrainData
from treadle.server.config import InputLimits
from treadle.server.tenancy.auth import Tenant, current_key_id
from treadle.server.tenancy.quotas import (
    QuotaBook,
    Quotas,
    RateLimiter,
    check_rank,
    check_slot,
    over,
)
from treadle.server.tenancy.spend import SpendBook


def request_tokens(
    limits: InputLimits, base_model: str, payload: Payload
) -> tuple[int, str] | None:
    """Check an operation against the input limits; → (its tokens, what they are) for the
    token quota, or None for operations that carry no tokens."""
    max_len = limits.max_seq_len.get(base_model)
    if isinstance(payload, TrainData):
        lengths = [len(d.tokens) for d in payload.data]
        tokens = sum(lengths)
        if max_len is not None and max(lengths) > max_len:
            i = lengths.index(max(lengths))
            raise InvalidRequestError(
                f"data[{i}].model_input: length {lengths[i]} exceeds the input limit "
                f"max_seq_len {max_len} of model {base_model!r}"
            )
        if limits.max_batch_tokens is not None and tokens > limits.max_batch_tokens:
            raise InvalidRequestError(
                f"data: {tokens} tokens in one request exceed the input limit "
                f"max_batch_tokens {limits.max_batch_tokens}; send a smaller batch"
            )
        return tokens, "model-input tokens"
    if not isinstance(payload, Sample):
        return None
    req = payload.request
    n, max_tokens, prompt = req.num_samples, req.params.max_tokens, len(req.prompt)
    if n > limits.max_num_samples:
        raise InvalidRequestError(
            f"num_samples: {n} exceeds the input limit max_num_samples {limits.max_num_samples}"
        )
    if limits.max_sample_tokens is not None and max_tokens > limits.max_sample_tokens:
        raise InvalidRequestError(
            f"sampling_params.max_tokens: {max_tokens} exceeds the input limit "
            f"max_sample_tokens {limits.max_sample_tokens}"
        )
    if max_len is not None and prompt + max_tokens > max_len:
        raise InvalidRequestError(
            f"prompt: {prompt} prompt tokens + max_tokens {max_tokens} exceed the input "
            f"limit max_seq_len {max_len} of model {base_model!r}"
        )
    return prompt + n * max_tokens, "prompt + num_samples × max_tokens"


def default_max_tokens(
    limits: InputLimits, base_model: str, context: int, prompt_len: int
) -> int | None:
    """max_tokens for a sample request that gives none: the room the limits leave (None
    without limits: the room the model's context leaves, as before)."""
    if limits.max_sample_tokens is None and base_model not in limits.max_seq_len:
        return None
    room = min(context, limits.max_seq_len.get(base_model, context)) - prompt_len
    if limits.max_sample_tokens is not None:
        room = min(room, limits.max_sample_tokens)
    return max(room, 1)


class Admission:
    """Input limits and quotas, per tenant: one place that says yes or no."""

    def __init__(
        self,
        limits: InputLimits,
        quotas: QuotaBook,
        rate_window_s: float = 60.0,
        spend: SpendBook | None = None,
    ):
        self.limits = limits
        self.quotas = quotas
        self.rate = RateLimiter(rate_window_s)
        self.spend = spend

    def quotas_of(self, tenant: Tenant) -> Quotas:
        return self.quotas.of(tenant.tenant_id, tenant.name)

    def check_op(self, tenant: Tenant, base_model: str, kind: OpKind, payload: Payload) -> None:
        """An operation's input limits (InvalidRequestError), its tokens against the
        max_tokens_per_request quota, the spend caps of the tenant and of the request's key
        (metered operations only) and the tenant's requests_per_minute (QuotaExceededError)."""
        quotas = self.quotas_of(tenant)
        counted = request_tokens(self.limits, base_model, payload)
        quota = quotas.max_tokens_per_request
        if counted is not None and quota is not None and counted[0] > quota:
            tokens, what = counted
            asked = f"this request has {tokens} {what}"
            raise over("max_tokens_per_request", quota, asked, "send smaller requests", None)
        if self.spend is not None and kind in METERED_KINDS:
            self.spend.check(tenant, current_key_id())
        self.rate.take(tenant.tenant_id, quotas.requests_per_minute)

    def check_sessions(self, tenant: Tenant, active: int) -> None:
        limit = self.quotas_of(tenant).max_concurrent_sessions
        if limit is not None:
            what = f"tenant {tenant.name!r} has {active} active sessions"
            check_slot("max_concurrent_sessions", limit, active, what)

    def check_adapters(self, tenant: Tenant, held: int) -> None:
        limit = self.quotas_of(tenant).max_adapters_in_memory
        if limit is not None:
            what = f"tenant {tenant.name!r} holds {held} adapters"
            check_slot("max_adapters_in_memory", limit, held, what)

    def check_rank(self, tenant: Tenant, rank: int) -> None:
        check_rank(self.quotas_of(tenant), rank)

    def default_max_tokens(self, base_model: str, context: int, prompt_len: int) -> int | None:
        return default_max_tokens(self.limits, base_model, context, prompt_len)
