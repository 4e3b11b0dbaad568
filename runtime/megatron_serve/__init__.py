"""megatron-serve runtime: engine, coordinator, client, high-level API, HTTP server and CLI."""

from .config import InferenceConfig
from .llm import MegatronLLM
from .request import DynamicInferenceRequest, EventType, FinishReason, RequestStatus
from .sampling_params import SamplingParams

__all__ = [
    "DynamicInferenceRequest",
    "InferenceClient",
    "MegatronAsyncLLM",
    "EventType",
    "FinishReason",
    "InferenceConfig",
    "MegatronLLM",
    "RequestStatus",
    "SamplingParams",
]

_LAZY = {"InferenceClient": ".client", "MegatronAsyncLLM": ".async_llm"}  # imported on first use


def __getattr__(name: str):
    if name in _LAZY:
        import importlib  # noqa: PLC0415

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
