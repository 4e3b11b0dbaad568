"""vLLM's ``vllm.lora.request.LoRARequest``, defined in :mod:`megatron_serve.client.lora_request`."""

from ..client.lora_request import LoRARequest

__all__ = ["LoRARequest"]
