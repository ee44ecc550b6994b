"""Treadle: self-hosted training sessions for LLM post-training.

The client SDK lives here; `treadle.engine` and `treadle.server` need the `server` extra.
"""

from treadle.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoraConfig,
    ModelInput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    TensorData,
)

__all__ = [
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "LoraConfig",
    "ModelInput",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "TensorData",
]
