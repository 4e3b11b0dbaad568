"""Whether an engine can take a request at all, checked once when it is added: a request it could never run fails
alone, with a message naming what is wrong, instead of stalling the queue or failing a step."""

from __future__ import annotations

from ..model.config import ModelConfig
from ..wire.request import DynamicInferenceRequest
from .encoder_cache import EncoderCache
from .kv_cache import blocks_for_tokens
from .lora_verbs import routing_problem


def admission_problem(request: DynamicInferenceRequest, model_config: ModelConfig, encoder_cache: EncoderCache | None,
                      max_sequence_length: int, block_size: int, kv_blocks_total: int, *, known: bool) -> str | None:
    """Why this engine can never run ``request`` (``known``: its id is already here), or None."""
    prompt_len = len(request.prompt_tokens)
    if known:
        return f"request id {request.request_id!r} is already in this engine"
    if prompt_len == 0:
        return "prompt is empty"
    vocab = model_config.vocab_size
    if any(not 0 <= t < vocab for t in request.prompt_tokens):
        return f"prompt holds token ids outside the vocabulary [0, {vocab})"
    outside = [t for t in request.sampling_params.logit_bias or {} if t >= vocab]
    if outside:
        return f"logit_bias names token id {outside[0]}, outside the vocabulary [0, {vocab})"
    outside = [t for t in request.sampling_params.stop_token_ids if t >= vocab]
    if outside:
        return f"stop_token_ids names token id {outside[0]}, outside the vocabulary [0, {vocab})"
    if encoder_cache is not None:
        problem = encoder_cache.admission_problem(request)
        if problem is not None:
            return problem
    elif request.images:
        return f"this model ({model_config.architecture}) takes no images"
    if prompt_len >= max_sequence_length:
        return (f"prompt has {prompt_len} tokens but max_sequence_length is {max_sequence_length} "
                "(prompt plus at least one generated token must fit)")
    if request.sampling_params.return_routing_indices:
        problem = routing_problem(model_config, request)
        if problem is not None:
            return problem
    total = min(prompt_len + request.sampling_params.num_tokens_to_generate, max_sequence_length)
    needed = blocks_for_tokens(total, block_size)
    if needed > kv_blocks_total:
        return (f"request needs {needed} KV blocks ({total} tokens) but the pool holds {kv_blocks_total}: "
                "raise num_kv_blocks or lower num_tokens_to_generate")
    return None
