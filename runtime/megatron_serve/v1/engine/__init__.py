"""vLLM's ``vllm.v1.engine`` import path (see :mod:`megatron_serve.v1`)."""
