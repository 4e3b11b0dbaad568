"""Long prompts share the engine's steps with short ones (``long_prefill_token_threshold``), on a tiny model: a
short request added during the prefill of several long scored prompts finishes before they sample their first
token, its control (threshold 0) after; every request's tokens are the same with the threshold on and off, and
under ``batch_invariant`` its log probs and prompt log probs too, bitwise (without it a prompt's log probs depend on
how it is chunked in their last bits, as they do on ``max_batch_tokens``).
"""

from __future__ import annotations

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine

SCORED = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True, return_log_probs=True,
                        return_prompt_log_probs=True, top_n_logprobs=3)
SHORT = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True, return_log_probs=True)


def play(tiny_llama: str, threshold: int, batch_invariant: bool = False
         ) -> tuple[list[str], dict[str, DynamicInferenceRequest]]:
    """Three 300-token scored prompts, then (after one step) a short one; the order the requests finished in."""
    engine = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(
        block_size_tokens=16, max_batch_tokens=64, long_prefill_token_threshold=threshold, async_scheduling=False,
        batch_invariant=batch_invariant))
    requests = {}
    for index in range(3):
        prompt = [3 + (index * 7 + i) % 200 for i in range(300)]
        requests[f"long{index}"] = DynamicInferenceRequest(request_id=f"long{index}", prompt=None,
                                                           prompt_tokens=prompt, sampling_params=SCORED)
        engine.add_request(requests[f"long{index}"])
    finished: list[str] = []
    finished += [out.request.request_id for out in engine.step() if out.finished]
    requests["short"] = DynamicInferenceRequest(request_id="short", prompt=None, prompt_tokens=[11, 12, 13],
                                                sampling_params=SHORT)
    engine.add_request(requests["short"])
    while engine.has_unfinished_requests():
        finished += [out.request.request_id for out in engine.step() if out.finished]
    return finished, requests


def test_a_short_request_finishes_during_long_prefills_with_the_same_tokens(tiny_llama):
    fair_order, fair = play(tiny_llama, threshold=16)
    control_order, control = play(tiny_llama, threshold=0)
    assert fair_order[0] == "short"  # four tokens while 900 prompt tokens are computed 64 a step
    assert control_order.index("short") >= 1  # control: behind the long prompts that came first
    for name, request in fair.items():
        assert request.generated_tokens == control[name].generated_tokens and len(request.generated_tokens) == 4


def test_under_batch_invariance_every_log_prob_is_bitwise_unchanged(tiny_llama):
    fair_order, fair = play(tiny_llama, threshold=16, batch_invariant=True)
    control_order, control = play(tiny_llama, threshold=0, batch_invariant=True)
    assert fair_order[0] == "short" and control_order.index("short") >= 1
    for name, request in fair.items():
        other = control[name]
        assert request.generated_tokens == other.generated_tokens
        assert request.generated_log_probs == other.generated_log_probs
        assert request.prompt_log_probs == other.prompt_log_probs
        assert request.prompt_top_n_logprobs == other.prompt_top_n_logprobs
    assert len(fair["long0"].prompt_log_probs) == 299
