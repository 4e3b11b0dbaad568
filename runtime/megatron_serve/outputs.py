"""vLLM's ``vllm.outputs`` names (``RequestOutput``, ``CompletionOutput``), for imports written against vLLM; they
are defined in :mod:`.client.vllm_outputs`."""

from .client.vllm_outputs import CompletionOutput, RequestOutput

__all__ = ["CompletionOutput", "RequestOutput"]
