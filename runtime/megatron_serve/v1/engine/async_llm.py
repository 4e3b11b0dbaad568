"""vLLM's ``vllm.v1.engine.async_llm``: ``AsyncLLM`` (see :mod:`megatron_serve.api.vllm_engine`)."""

from ...api.vllm_engine import AsyncLLM

__all__ = ["AsyncLLM"]
