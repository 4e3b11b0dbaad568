"""megatron-serve runtime: engine, coordinator, client, high-level API, HTTP server and CLI.

Public names are imported on first use (PEP 562), so that light processes (``megatron-serve
control``, the coordinator) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any, Callable

# The distribution's one version: pyproject.toml reads it from here, and the CLI (--version), the
# HTTP server (OpenAPI), the operator's default image tag, the image label and the chart's
# appVersion all equal it (tests/release/test_versions.py keeps them equal).
__version__ = "0.1.0"

_EXPORTS = {
    "AsyncEngineArgs": ".client.vllm_engine",
    "AsyncLLM": ".client.vllm_engine",
    "AsyncLLMEngine": ".client.vllm_engine",
    "CompletionOutput": ".client.vllm_outputs",
    "EngineArgs": ".client.vllm_engine",
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
    from .client.async_llm import MegatronAsyncLLM
    from .client.coordinator_client import InferenceClient
    from .config import InferenceConfig
    from .client.llm import LLM, MegatronLLM
    from .client.lora_request import LoRARequest
    from .client.prompts import TextPrompt, TokensPrompt
    from .client.vllm_engine import AsyncEngineArgs, AsyncLLM, AsyncLLMEngine, EngineArgs
    from .client.vllm_outputs import CompletionOutput, Logprob, RequestOutput
    from .wire.request import DynamicInferenceRequest, EventType, FinishReason, RequestStatus
    from .client.weight_sender import WeightSender, WeightTransferError
    from .wire.sampling_params import RequestOutputKind, SamplingParams
    from .weights.shards import Shard


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """PEP 562 ``__getattr__`` and ``__dir__`` for ``package``, whose names in ``exports`` (name -> its module,
    relative to the package) are imported on first use, so that a process pays for torch, FastAPI or the client only
    when it reads a name that needs them. Any other name is an ``AttributeError``: ``from package import submodule``
    then imports the submodule. This package and its ``model`` and ``server`` wings share it."""
    namespace = sys.modules[package].__dict__

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return getattr_, dir_


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
