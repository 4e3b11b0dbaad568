"""What the speculative-head tests (``mtp``, ``eagle3``) share: a batch-invariant float32 engine on CPU, greedy runs
of a few prompts, and the engine's guess counters."""

from __future__ import annotations

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine

from ..prompts import run_to_end


def engine_on(model_dir: str, speculative: dict | None) -> DynamicInferenceEngine:
    return DynamicInferenceEngine.from_model_dir(
        model_dir, InferenceConfig(device="cpu", dtype="float32", batch_invariant=True, speculative=speculative))


def greedy_runs(engine: DynamicInferenceEngine, prompts: list[list[int]], tag: str = "r", *, count: int
                ) -> list[tuple[list, list]]:
    """Each prompt's ``count`` greedy tokens and their log probs, all requests in flight together."""
    requests = [DynamicInferenceRequest(f"{tag}{i}", None, prompt, SamplingParams(
        temperature=0.0, num_tokens_to_generate=count, ignore_eos=True, return_log_probs=True))
        for i, prompt in enumerate(prompts)]
    run_to_end(engine, requests)
    return [(request.generated_tokens, request.generated_log_probs) for request in requests]


def counts(engine: DynamicInferenceEngine) -> tuple[int, int]:
    """(guesses verified, guesses accepted) so far."""
    counters = engine.stats.counters
    return counters.get("spec_decode_num_draft_tokens", 0), counters.get("spec_decode_num_accepted_tokens", 0)


def record_guesses(proposer) -> list[tuple[list[int], list[int]]]:
    """From now on, each non-empty guess of ``proposer`` with the tokens it was made from, in order."""
    recorded: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def recording(inputs):
        guesses = propose(inputs)
        recorded.extend((list(item.token_ids), guess) for item, guess in zip(inputs, guesses) if guess)
        return guesses

    proposer.propose = recording
    return recorded
