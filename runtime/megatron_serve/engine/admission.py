"""Whether an engine can take a request at all, checked once when it is added: a request it could never run fails
alone, with a message naming what is wrong, instead of stalling the queue or failing a step. A request it can run
becomes its one engine-side object (:class:`~.sequence.Sequence`) here, with its stop ids, seed and adapter."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from ..model.config import ModelConfig
from ..wire.expert_routing import RoutingCapture, routing_dtype
from ..wire.request import EngineRequest
from .encoder_cache import EncoderCache
from .kv.cache import blocks_for_tokens
from .lora.adapters import EngineLoras, LoraAdapterError, Registration, admit_request
from .sequence import Sequence
from .sampling.structured_output import StructuredOutputs


@dataclass
class Admission:
    """What an engine checks a new request against and builds its :class:`~.sequence.Sequence` from: the model's
    vocabulary, experts and images, the length and KV pool limits, the tokenizer's EOS ids, the adapters and the
    grammars (``structured``: None for an engine that takes none, such as a scheduler tested without a model)."""

    model_config: ModelConfig
    max_sequence_length: int
    block_size: int
    kv_blocks_total: int
    eos_token_ids: tuple[int, ...]
    seed: int | None = None  # seeds the draws of unseeded requests' own seeds (``InferenceConfig.seed``)
    encoder_cache: EncoderCache | None = None
    loras: EngineLoras | None = None
    structured: StructuredOutputs | None = None
    _seeds: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._seeds = random.Random(self.seed)  # an unseeded request's own seed, drawn when it is added

    def admit(self, request: EngineRequest, *, known: bool) -> tuple[Sequence, Registration | None] | str:
        """The request's sequence and adapter registration, or why it can never run here (``known``: its id is
        already in the engine). A grammar is compiled here, so a bad one fails the request alone."""
        sp = request.sampling_params
        stop_ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else frozenset(
            self.eos_token_ids if sp.termination_id is None
            else (sp.termination_id if isinstance(sp.termination_id, list) else [sp.termination_id])))
        max_total = min(len(request.prompt_tokens) + sp.num_tokens_to_generate, self.max_sequence_length)
        sequence = Sequence.of(request, max_total, stop_ids)
        brought = request.routing_indices if sp.return_routing_indices else None  # a continuation's expert rows
        try:
            rows = None if brought is None else brought.array()
        except ValueError as exc:
            return f"routing_indices: {exc}"
        problem = admission_problem(sequence, rows, self.model_config, self.encoder_cache, self.max_sequence_length,
                                    self.block_size, self.kv_blocks_total, known=known)
        if problem is not None:
            return problem
        try:
            registration = admit_request(self.loras, sp)
        except LoraAdapterError as exc:
            return str(exc)
        if sp.structured_outputs is not None:
            if self.structured is None:
                return "this engine takes no structured outputs"
            problem = self.structured.add(request.request_id, sp.structured_outputs, request.generated_tokens)
            if problem is not None:
                return problem
        sequence.seed = sp.seed if sp.seed is not None else self._seeds.getrandbits(63)
        if sp.return_routing_indices:
            moe = self.model_config.moe
            assert moe is not None, "admission_problem refuses routing on a dense model"
            sequence.routing = RoutingCapture(len(moe.sparse_layers), moe.top_k, routing_dtype(moe.num_experts),
                                              0 if rows is None else len(rows))
            sequence.reads_prefix_cache = False
        return sequence, registration


def admission_problem(sequence: Sequence, routing_rows: np.ndarray | None, model_config: ModelConfig,
                      encoder_cache: EncoderCache | None, max_sequence_length: int, block_size: int,
                      kv_blocks_total: int, *, known: bool) -> str | None:
    """Why this engine can never run ``sequence`` (``routing_rows``: the expert rows it brings; ``known``: its id is
    already here), or None."""
    prompt, params = sequence.prompt_tokens, sequence.sampling_params
    prompt_len = len(prompt)
    if known:
        return f"request id {sequence.request_id!r} is already in this engine"
    if prompt_len == 0:
        return "prompt is empty"
    vocab = model_config.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
        return f"prompt holds token ids outside the vocabulary [0, {vocab})"
    outside = [t for t in params.logit_bias or {} if t >= vocab]
    if outside:
        return f"logit_bias names token id {outside[0]}, outside the vocabulary [0, {vocab})"
    outside = [t for t in params.stop_token_ids if t >= vocab]
    if outside:
        return f"stop_token_ids names token id {outside[0]}, outside the vocabulary [0, {vocab})"
    unplaced = next((i for i, image in enumerate(sequence.images) if image.placed and image.length < 1), None)
    if unplaced is not None:
        return f"images[{unplaced}]: a placed image needs length >= 1"
    if encoder_cache is not None:
        problem = encoder_cache.admission_problem(prompt, sequence.images)
        if problem is not None:
            return problem
    elif sequence.images:
        return f"this model ({model_config.architecture}) takes no images"
    if prompt_len >= max_sequence_length:
        return (f"prompt has {prompt_len} tokens but max_sequence_length is {max_sequence_length} "
                "(prompt plus at least one generated token must fit)")
    if params.return_routing_indices:
        problem = routing_problem(model_config, routing_rows, len(sequence.token_ids))
        if problem is not None:
            return problem
    total = min(prompt_len + params.num_tokens_to_generate, max_sequence_length)
    needed = blocks_for_tokens(total, block_size)
    if needed > kv_blocks_total:
        return (f"request needs {needed} KV blocks ({total} tokens) but the pool holds {kv_blocks_total}: "
                "raise num_kv_blocks or lower num_tokens_to_generate")
    return None


def routing_problem(config: ModelConfig, rows: np.ndarray | None, num_tokens: int) -> str | None:
    """Why a request carrying the expert ``rows`` of its first positions (routing replay; ``num_tokens``: its
    prompt and generated tokens) cannot run on this model, or None."""
    moe = config.moe
    if moe is None or not moe.sparse_layers:
        return (f"return_routing_indices needs a mixture-of-experts model; {config.architecture} "
                "has no expert layers")
    if rows is None:
        return None
    if rows.shape[1:] != (len(moe.sparse_layers), moe.top_k):
        return (f"the request carries routing_indices of shape {rows.shape}, which do not fit this model's "
                f"{len(moe.sparse_layers)} MoE layers x top-{moe.top_k}")
    if rows.shape[0] > num_tokens:
        return f"the request carries {rows.shape[0]} routing rows, more than its tokens"
    return None
