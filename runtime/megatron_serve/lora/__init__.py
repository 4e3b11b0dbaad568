"""vLLM's ``vllm.lora`` package: only :mod:`.request` (``LoRARequest``), for imports written against vLLM."""
