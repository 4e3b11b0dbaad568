"""What a caller's process runs: the coordinator client (:class:`InferenceClient`), pending requests,
output processing and text, prompts, and the engine-client interface with its in-process engine; the synchronous
and asynchronous LLM fronts over them are :mod:`megatron_serve.api`'s.
"""
