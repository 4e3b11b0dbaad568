"""Prompts the engine and model tests run, and a helper that steps requests with different parameters together."""

from __future__ import annotations

from megatron_serve import DynamicInferenceRequest, SamplingParams


PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Kubernetes runs containers in pods; an operator watches resources",
    "1 2 3",
    "Once upon a time there was a small model that wanted to learn everything about the world",
    "def add(a, b):",
    "A paged cache splits memory into blocks of a fixed number of tokens, the way an operating system "
    "splits memory into pages. Requests own lists of blocks.",
    "What is the weather like?",
]


def run_requests(engine, jobs: list[tuple[str, SamplingParams]]) -> list[DynamicInferenceRequest]:
    """Requests with different parameters stepped together in one engine until all finish."""
    requests = [DynamicInferenceRequest(str(i), p, engine.tokenizer.encode(p), sp) for i, (p, sp) in enumerate(jobs)]
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    return requests
