"""vLLM's sampling parameters both ways: as the tokens-in routes take them (``/inference/v1/generate``'s
``sampling_params``, TRL's ``generation_kwargs``) and as ``render`` gives them back for a chat's resolved parameters.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...wire.sampling_params import SamplingParams
from ..errors import bad_request


class VllmSamplingParams(BaseModel):
    """vLLM's ``SamplingParams`` as ``/inference/v1/generate`` takes them (the fields this server honours; the ranges
    are those of ``/v1/completions``)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    n: int | None = None
    max_tokens: int | None = Field(None, description="default: the rest of the context window (vLLM's)")
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(None, description="log probs of each generated token: the sampled one and this many "
                                                    "others, listed as token_id:N")
    prompt_logprobs: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: dict[str, Any] | None = None
    # How vLLM makes and keeps its outputs: a tokens-out answer is the same whichever is chosen
    output_kind: Literal[0, 1, 2] | None = Field(None, description="accepted: a whole answer is the final output, "
                                                                   "a stream sends deltas (vLLM's rule)")
    detokenize: bool | None = Field(None, description="accepted: the answer holds no text")
    spaces_between_special_tokens: bool | None = Field(None, description="accepted: the answer holds no text")
    flat_logprobs: bool | None = Field(None, description="accepted: how vLLM stores log probs, not what it answers")
    extra_args: dict[str, Any] | None = Field(None, description="only prime-rl's prl_compact_logprobs (answered as "
                                                                "plain JSON log probs, which its client reads too)")


#: The fields above that change nothing in a tokens-out answer (see their descriptions).
_NO_EFFECT = frozenset({"output_kind", "detokenize", "spaces_between_special_tokens", "flat_logprobs", "extra_args"})
_EXTRA_ARGS = frozenset({"prl_compact_logprobs"})


def sampling_fields(params: VllmSamplingParams, where: str) -> dict[str, Any]:
    """The completions fields of vLLM's sampling parameters (found at ``where`` in the body), without those that
    change nothing in a tokens-out answer; an ``extra_args`` key no logits processor here reads is refused."""
    unknown = sorted(set(params.extra_args or {}) - _EXTRA_ARGS)
    if unknown:
        raise bad_request(f"{where}.extra_args.{unknown[0]}: no logits processor of this server reads it",
                          param=f"{where}.extra_args.{unknown[0]}", code="unsupported_parameter")
    return params.model_dump(exclude_none=True, exclude=set(_NO_EFFECT))


def vllm_sampling(params: SamplingParams, n: int) -> dict[str, Any]:
    """``params`` (a chat choice's) as the ``sampling_params`` of ``/inference/v1/generate`` that run the same."""
    fields: dict[str, Any] = {
        "n": n, "max_tokens": params.num_tokens_to_generate, "min_tokens": params.min_tokens,
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p,
        "seed": params.seed, "stop": list(params.stop_words), "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos, "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty, "repetition_penalty": params.repetition_penalty,
        "logprobs": params.top_n_logprobs if params.return_log_probs else None,
        "skip_special_tokens": params.skip_special_tokens,
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "logit_bias": {str(t): b for t, b in dict(params.logit_bias).items()} if params.logit_bias else None,
        "structured_outputs": params.structured_outputs.to_dict() if params.structured_outputs else None,
    }
    return {name: value for name, value in fields.items() if value is not None}
