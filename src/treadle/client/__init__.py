"""The treadle SDK: ServiceClient → TrainingClient / SamplingClient, every call an APIFuture."""

from treadle.client.errors import (
    APIConnectionError,
    APIError,
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    GoneError,
    InternalServerError,
    NotFoundError,
    RateLimitError,
    RequestFailedError,
)
from treadle.client.futures import APIFuture
from treadle.client.sampling import SamplingClient
from treadle.client.service import ServiceClient
from treadle.client.training import TrainingClient
from treadle.client.transport import RetryPolicy

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIFuture",
    "APIStatusError",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "GoneError",
    "InternalServerError",
    "NotFoundError",
    "RateLimitError",
    "RequestFailedError",
    "RetryPolicy",
    "SamplingClient",
    "ServiceClient",
    "TrainingClient",
]
