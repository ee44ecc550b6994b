"""Treadle: self-hosted training sessions for LLM post-training.

The client SDK lives here; `treadle.engine` and `treadle.server` need the `server` extra.
The names below load on first use, so that a process that runs only the server or an engine
worker (`import treadle.worker...`) never imports the SDK's HTTP stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "APIFuture",
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "LoraConfig",
    "ModelInput",
    "PromptProvenanceSpan",
    "RequestFailedError",
    "SampleResponse",
    "SampledProvenanceSpan",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "ServiceClient",
    "TensorData",
    "TrainingClient",
]

_CLIENT = {"APIFuture", "RequestFailedError", "SamplingClient", "ServiceClient", "TrainingClient"}

if TYPE_CHECKING:
    from treadle.client import (
        APIFuture,
        RequestFailedError,
        SamplingClient,
        ServiceClient,
        TrainingClient,
    )
    from treadle.types import (
        AdamParams,
        Datum,
        EncodedTextChunk,
        ForwardBackwardOutput,
        LoraConfig,
        ModelInput,
        PromptProvenanceSpan,
        SampledProvenanceSpan,
        SampledSequence,
        SampleResponse,
        SamplingParams,
        TensorData,
    )


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'treadle' has no attribute {name!r}")
    module = "treadle.client" if name in _CLIENT else "treadle.types"
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
