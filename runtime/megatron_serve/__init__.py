"""megatron-serve runtime: engine, coordinator, client, high-level API, HTTP server and CLI.

Public names are imported on first use (PEP 562), so that light processes (``megatron-serve
control``, the coordinator) do not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .package import __version__, lazy_exports

_EXPORTS = {
    "AsyncEngineArgs": ".api.vllm_engine",
    "AsyncLLM": ".api.vllm_engine",
    "AsyncLLMEngine": ".api.vllm_engine",
    "CompletionOutput": ".client.vllm_outputs",
    "EngineArgs": ".api.vllm_engine",
    "DynamicInferenceRequest": ".wire.request",
    "EventType": ".wire.request",
    "FinishReason": ".wire.request",
    "InferenceClient": ".client.coordinator_client",
    "InferenceConfig": ".config",
    "LLM": ".api.llm",
    "LoRARequest": ".client.lora_request",
    "Logprob": ".client.vllm_outputs",
    "MegatronAsyncLLM": ".api.async_llm",
    "MegatronLLM": ".api.llm",
    "RequestOutput": ".client.vllm_outputs",
    "RequestOutputKind": ".wire.sampling_params",
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
    from .api.async_llm import MegatronAsyncLLM
    from .client.coordinator_client import InferenceClient
    from .config import InferenceConfig
    from .api.llm import LLM, MegatronLLM
    from .client.lora_request import LoRARequest
    from .client.prompts import TextPrompt, TokensPrompt
    from .api.vllm_engine import AsyncEngineArgs, AsyncLLM, AsyncLLMEngine, EngineArgs
    from .client.vllm_outputs import CompletionOutput, Logprob, RequestOutput
    from .wire.request import DynamicInferenceRequest, EventType, FinishReason, RequestStatus
    from .client.weight_sender import WeightSender, WeightTransferError
    from .wire.sampling_params import RequestOutputKind, SamplingParams
    from .weights.shards import Shard


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
