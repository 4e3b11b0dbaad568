"""megatron-serve runtime: engine, coordinator, client, high-level API, HTTP server and CLI.

Public names are imported on first use (PEP 562), so that light processes (``megatron-serve
control``, the coordinator) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The distribution's one version: pyproject.toml reads it from here, and the CLI (--version), the
# HTTP server (OpenAPI), the operator's default image tag, the image label and the chart's
# appVersion all equal it (tests/release/test_versions.py keeps them equal).
__version__ = "0.1.0"

_EXPORTS = {
    "CompletionOutput": ".client.vllm_outputs",
    "DynamicInferenceRequest": ".wire.request",
    "EventType": ".wire.request",
    "FinishReason": ".wire.request",
    "InferenceClient": ".client.coordinator_client",
    "InferenceConfig": ".config",
    "LLM": ".client.llm",
    "LoRARequest": ".client.lora_request",
    "Logprob": ".client.vllm_outputs",
    "MegatronAsyncLLM": ".client.async_llm",
    "MegatronLLM": ".client.llm",
    "RequestOutput": ".client.vllm_outputs",
    "RequestStatus": ".wire.request",
    "SamplingParams": ".wire.sampling_params",
    "Shard": ".weights.shards",
    "TextPrompt": ".client.prompts",
    "TokensPrompt": ".client.prompts",
    "WeightSender": ".client.weight_sender",
    "WeightTransferError": ".client.weight_sender",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .client.async_llm import MegatronAsyncLLM
    from .client.coordinator_client import InferenceClient
    from .config import InferenceConfig
    from .client.llm import LLM, MegatronLLM
    from .client.lora_request import LoRARequest
    from .client.prompts import TextPrompt, TokensPrompt
    from .client.vllm_outputs import CompletionOutput, Logprob, RequestOutput
    from .wire.request import DynamicInferenceRequest, EventType, FinishReason, RequestStatus
    from .client.weight_sender import WeightSender, WeightTransferError
    from .wire.sampling_params import SamplingParams
    from .weights.shards import Shard


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
