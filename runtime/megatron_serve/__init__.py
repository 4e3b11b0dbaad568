"""megatron-serve runtime: engine, coordinator, client, high-level API, HTTP server and CLI."""

from .config import InferenceConfig
from .llm import MegatronLLM
from .request import DynamicInferenceRequest, EventType, FinishReason, RequestStatus
from .sampling_params import SamplingParams

__all__ = [
    "DynamicInferenceRequest",
    "EventType",
    "FinishReason",
    "InferenceConfig",
    "MegatronLLM",
    "RequestStatus",
    "SamplingParams",
]
