"""Prompts the engine and model tests run, and the helpers that step requests in one engine until they finish."""

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
    return run_to_end(engine, [DynamicInferenceRequest(str(i), p, engine.tokenizer.encode(p), sp)
                               for i, (p, sp) in enumerate(jobs)])


def run_steps(engine, requests: list[DynamicInferenceRequest], steps: int) -> list[DynamicInferenceRequest]:
    """Add ``requests`` to ``engine`` (an engine in this process) and step it ``steps`` times, so that a verb or a
    second engine meets them part way; the requests."""
    for request in requests:
        engine.add_request(request)
    for _ in range(steps):
        engine.step()
    return requests


def run_to_end(engine, requests: list[DynamicInferenceRequest]) -> list[DynamicInferenceRequest]:
    """Add ``requests`` to ``engine`` (an engine in this process) and step it until every one has finished; the
    requests, filled in by the steps."""
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    return requests
