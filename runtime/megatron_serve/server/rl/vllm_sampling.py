"""vLLM's sampling parameters both ways: as the tokens-in routes take them (``/inference/v1/generate``'s
``sampling_params``, TRL's ``generation_kwargs``) and as ``render`` gives them back for a chat's resolved parameters.

The body's sampling fields are the table's rows under their vLLM names (``wire/sampling_fields.py``, through
:mod:`.sampling_bodies`); what this route adds (descriptions, vLLM's fields that change nothing in a tokens-out
answer) is the data below.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ...wire.sampling_fields import COPIED
from ...wire.sampling_params import SamplingParams
from ..errors import bad_request
from .sampling_bodies import completions_names, sampling_body

#: The copied sampling parameters vLLM's SamplingParams has (what ``render`` gives back of them, by vLLM's names).
_COPIED_VLLM = [row for row in COPIED if row.vllm is not None]
#: vLLM name -> the completions field, where they differ.
_COMPLETIONS_NAME = completions_names("vllm")
#: vLLM's fields that this route describes further (its defaults are the server's, not vLLM's class's).
DESCRIPTIONS = {
    "max_tokens": "default: the rest of the context window (vLLM's)",
    "logprobs": "log probs of each generated token: the sampled one and this many others, listed as token_id:N",
}
#: vLLM's fields that change nothing in a tokens-out answer, and prime-rl's logits-processor arguments.
NO_EFFECT: dict[str, tuple[Any, Any]] = {
    # How vLLM makes and keeps its outputs: a tokens-out answer is the same whichever is chosen
    "output_kind": (Literal[0, 1, 2] | None, Field(None, description="accepted: a whole answer is the final "
                                                                        "output, a stream sends deltas (vLLM's rule)")),
    "detokenize": (bool | None, Field(None, description="accepted: the answer holds no text")),
    "spaces_between_special_tokens": (bool | None, Field(None, description="accepted: the answer holds no text")),
    "flat_logprobs": (bool | None, Field(None, description="accepted: how vLLM stores log probs, not what it "
                                                              "answers")),
    "extra_args": (dict[str, Any] | None, Field(None, description="only prime-rl's prl_compact_logprobs (answered "
                                                                     "as plain JSON log probs, which its client reads "
                                                                     "too)")),
}

VllmSamplingParams = sampling_body(
    "VllmSamplingParams", "vllm", """vLLM's ``SamplingParams`` as ``/inference/v1/generate`` takes them: every row of
    the sampling table with a vLLM name (the ranges are those of ``/v1/completions``), and the fields that change
    nothing in a tokens-out answer.""", descriptions=DESCRIPTIONS, own=NO_EFFECT)


_EXTRA_ARGS = frozenset({"prl_compact_logprobs"})


def sampling_fields(params: VllmSamplingParams, where: str) -> dict[str, Any]:
    """The completions fields of vLLM's sampling parameters (found at ``where`` in the body), without those that
    change nothing in a tokens-out answer; an ``extra_args`` key no logits processor here reads is refused."""
    unknown = sorted(set(params.extra_args or {}) - _EXTRA_ARGS)
    if unknown:
        raise bad_request(f"{where}.extra_args.{unknown[0]}: no logits processor of this server reads it",
                          param=f"{where}.extra_args.{unknown[0]}", code="unsupported_parameter")
    given = params.model_dump(exclude_none=True, exclude=set(NO_EFFECT))
    return {_COMPLETIONS_NAME.get(name, name): value for name, value in given.items()}


def vllm_sampling(params: SamplingParams, n: int) -> dict[str, Any]:
    """``params`` (a chat choice's) as the ``sampling_params`` of ``/inference/v1/generate`` that run the same."""
    fields: dict[str, Any] = {
        "n": n, "max_tokens": params.num_tokens_to_generate, **{row.vllm: getattr(params, row.name) for row in _COPIED_VLLM},
        "stop": list(params.stop_words), "stop_token_ids": list(params.stop_token_ids),
        "logprobs": params.top_n_logprobs if params.return_log_probs else None,
        "logit_bias": {str(t): b for t, b in dict(params.logit_bias).items()} if params.logit_bias else None,
        "structured_outputs": params.structured_outputs.to_dict() if params.structured_outputs else None,
    }
    return {name: value for name, value in fields.items() if value is not None}
