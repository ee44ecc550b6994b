"""Treadle: self-hosted training sessions for LLM post-training.

The client SDK lives here; `treadle.engine` and `treadle.server` need the `server` extra.
"""

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
