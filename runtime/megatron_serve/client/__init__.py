"""What a caller's process runs: the coordinator client (:class:`InferenceClient`), pending requests,
output processing and text, prompts, and the synchronous and asynchronous LLM fronts.
"""
