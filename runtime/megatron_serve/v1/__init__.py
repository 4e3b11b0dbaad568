"""vLLM's ``vllm.v1`` import paths, for code that imports its engine from there (``megatron_serve.v1.engine.async_llm``
is ``vllm.v1.engine.async_llm``); the definitions live in :mod:`megatron_serve.api.vllm_engine`."""
