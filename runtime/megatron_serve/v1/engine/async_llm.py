"""vLLM's ``vllm.v1.engine.async_llm``: ``AsyncLLM`` (see :mod:`megatron_serve.client.vllm_engine`)."""

from ...client.vllm_engine import AsyncLLM

__all__ = ["AsyncLLM"]
