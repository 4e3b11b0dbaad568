"""From an OpenAI request body to engine requests: prompts as token ids and ``SamplingParams``.

Everything a request can get wrong is found here, before anything is submitted, and answered
with a 400 that names the parameter (a 404 for an unknown model, as OpenAI and vLLM answer): a prompt
that does not fit the context,
token ids outside the vocabulary, parameters this server cannot honour. The engine would refuse
some of these too, but only after a round trip through the coordinator and without a status code.

Prompts are tokenized here (not by the coordinator) so that the context check and the usage
counts see exactly the tokens the engine will run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..tokenizer import Tokenizer
from ..generation_config import GenerationDefaults
from ..limits import RequestLimits
from ..multimodal import PromptImage
from ..wire.placement import Placement
from ..wire.sampling_fields import COPIED, copied_from_http
from ..wire.sampling_params import SamplingParamError, SamplingParams, StructuredOutputsParams, stop_list
from ..grammar import constraint_bytes, grammar_error
from ..tokenizer import PromptTooLong
from .errors import APIError, bad_request, unsupported
from .params_memo import ParamsMemo
from .vllm_fields import RESERVED_TEMPLATE_KWARGS
from .models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ImageContentPart,
    TextContentPart,
    _SamplingRequest,
)

def extension_fields(req: _SamplingRequest, result: Any) -> dict[str, list]:
    """The extensions one choice was asked for: per-token weight epochs, per-token expert routing."""
    fields: dict[str, list] = {}
    if req.return_epochs:
        fields["policy_epochs"] = list(getattr(result, "policy_epochs", None) or [])
        fields["kv_epochs"] = list(getattr(result, "kv_epochs", None) or [])
        fields["lora_epochs"] = list(getattr(result, "lora_epochs", None) or [])
    if req.return_routing_indices:
        routing = getattr(result, "routing_indices", None)
        fields["routing_indices"] = [] if routing is None else routing.tolist()
    return fields


#: OpenAI's default ``max_tokens`` of the completions endpoint.
DEFAULT_COMPLETION_TOKENS = 16


@dataclass
class Prompt:
    """One prompt as the engine will see it; ``text`` is kept for ``echo``."""

    tokens: list[int]
    text: str | None = None
    images: list[PromptImage] = field(default_factory=list)  # placed in ``tokens`` (vision-language models)


@dataclass
class EngineJob:
    """One engine request: choice ``index`` of the response, for prompt ``prompt_index``."""

    index: int
    prompt_index: int
    prompt: Prompt
    params: SamplingParams
    placement: Placement | None = None  # its session and data-parallel rank (server.placement)


def check_model(requested: str, served: list[str]) -> None:
    if requested not in served:
        raise APIError(404, f"The model '{requested}' does not exist here; this server serves "
                            f"{', '.join(repr(n) for n in served)} (see GET /v1/models)",
                       param="model", code="model_not_found")


def check_common(req: _SamplingRequest) -> None:
    """Checks of both endpoints that the body's schema cannot express."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if req.use_beam_search:
        raise unsupported("use_beam_search", "beam search (this server samples; send use_beam_search false or "
                                             "leave it out)")


def _logit_bias(req: _SamplingRequest, vocab_size: int | None) -> dict[int, float] | None:
    """``logit_bias`` with its keys as token ids (the API sends them as strings)."""
    if not req.logit_bias:
        return None
    bias = {}
    for key, value in req.logit_bias.items():
        if not (key.isascii() and key.isdigit()) or (vocab_size is not None and int(key) >= vocab_size):
            raise bad_request(f"logit_bias: key {key!r} is not a token id of this model's vocabulary [0, "
                              f"{vocab_size})", param="logit_bias", code="invalid_token_id")
        bias[int(key)] = value
    return bias


def _token_ids(name: str, ids: list[int] | None, vocab_size: int | None) -> list[int]:
    """The token ids of request field ``name``, each of the vocabulary (the count is checked with the limits)."""
    ids = list(ids or [])
    outside = next((t for t in ids if vocab_size is not None and t >= vocab_size), None)
    if outside is not None:
        raise bad_request(f"{name}: {outside} is not a token id of this model's vocabulary [0, {vocab_size})",
                          param=name, code="invalid_token_id")
    return ids


#: The copied rows that are lists of token ids (``allowed_token_ids``): checked against the vocabulary as
#: ``stop_token_ids`` is.
_TOKEN_ID_ROWS = tuple(row for row in COPIED if row.kind is list)


def structured_outputs(req: _SamplingRequest, limits: RequestLimits,
                       tool_constraint: tuple[str, StructuredOutputsParams] | None = None
                       ) -> StructuredOutputsParams | None:
    """The one output constraint of a request (``response_format``, ``guided_*`` or tools), checked.

    A schema, regex or grammar that cannot be used is a 400 naming its parameter; two constraints
    at once are a 400 too (one would be silently ignored otherwise). Choices over the ``limits``
    are refused before they are compiled, and a constraint that takes longer than the limit's
    compile timeout to check is refused.
    """
    given: list[tuple[str, dict]] = []
    if req.guided_json is not None:
        given.append(("guided_json", {"json": req.guided_json}))
    if req.guided_regex is not None:
        given.append(("guided_regex", {"regex": req.guided_regex}))
    if req.guided_choice is not None:
        given.append(("guided_choice", {"choice": req.guided_choice}))
    if req.guided_grammar is not None:
        given.append(("guided_grammar", {"grammar": req.guided_grammar}))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs.given()))
    response_format = req.response_format
    if response_format is not None and response_format.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise bad_request("response_format: type 'json_schema' needs json_schema.schema",
                              param="response_format.json_schema")
        given.append(("response_format", {"json": response_format.json_schema.schema_}))
    if tool_constraint is not None:
        given.append((tool_constraint[0], tool_constraint[1].to_dict()))
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"{given[0][0]} and {given[1][0]} both constrain the output: give only one",
                          param=given[1][0], code="conflicting_parameters")
    param, spec = given[0]
    try:
        constraint = StructuredOutputsParams(**spec)
    except ValueError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None
    check_constraint_size(constraint, limits, param)
    problem = grammar_error(constraint, timeout=limits.grammar_compile_timeout)
    if problem is not None:
        raise bad_request(f"{param}: this constraint cannot be used: {problem}", param=param,
                          code="invalid_constraint")
    return constraint


def check_constraint_size(constraint: StructuredOutputsParams, limits: RequestLimits, param: str) -> None:
    """The limits on an output constraint, before it is compiled (see :class:`~megatron_serve.limits.RequestLimits`)."""
    if constraint.choice is not None and len(constraint.choice) > limits.max_guided_choices:
        raise bad_request(f"{param} holds {len(constraint.choice)} choices; this server allows at most "
                          f"{limits.max_guided_choices}", param=param)
    size = constraint_bytes(constraint)
    if size > limits.max_constraint_bytes:
        raise bad_request(f"{param} is {size} bytes long; this server allows output constraints of at most "
                          f"{limits.max_constraint_bytes} bytes", param=param)


def check_tokens(tokens: list[int], vocab_size: int | None, param: str) -> None:
    if not tokens:
        raise bad_request(f"{param} is empty (it encodes to no tokens)", param=param)
    if vocab_size is not None and max(tokens) >= vocab_size:  # max() in C: a long prompt costs no Python loop
        bad = next(t for t in tokens if t >= vocab_size)
        raise bad_request(f"{param} holds token id {bad}, outside the vocabulary [0, {vocab_size})", param=param,
                              code="invalid_token_id")


def context_exceeded(max_model_len: int, prompt_len: int, param: str) -> APIError:
    return APIError(400, f"This model's maximum context length is {max_model_len} tokens, and your prompt has "
                         f"{prompt_len} tokens (the prompt plus at least one generated token must fit). "
                         "Please shorten the prompt.", param=param, code="context_length_exceeded")


def tokenize(tokenizer: Tokenizer, text: str, max_model_len: int | None, param: str, add_special_tokens: bool = True,
             ) -> list[int]:
    """``text`` as token ids; a text too long for the context is refused without listing its ids."""
    limit = None if max_model_len is None else max_model_len - 1
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens, max_tokens=limit))
    except PromptTooLong as exc:
        raise context_exceeded(max_model_len or 0, exc.tokens, param) from None


def truncation(req: _SamplingRequest, max_model_len: int | None) -> int | None:
    """How many prompt tokens ``truncate_prompt_tokens`` keeps (None: all); -1 is the context length."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return None
    if keep == 0:
        raise bad_request("truncate_prompt_tokens must be -1 (the context length) or >= 1, got 0",
                          param="truncate_prompt_tokens")
    if keep == -1:
        if max_model_len is None:
            raise bad_request("truncate_prompt_tokens -1 needs a known context length", param="truncate_prompt_tokens")
        return max_model_len
    if max_model_len is not None and keep > max_model_len:
        raise bad_request(f"truncate_prompt_tokens ({keep}) is larger than this model's context length "
                          f"({max_model_len})", param="truncate_prompt_tokens")
    return keep


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer, vocab_size: int | None,
                       max_model_len: int | None) -> list[Prompt]:
    """The prompt field in any of its four shapes, as a list of tokenized prompts (each cut to its last
    ``truncate_prompt_tokens`` tokens when asked)."""
    raw = req.prompt
    if isinstance(raw, str):
        items: list[str | list[int]] = [raw]
    elif raw and isinstance(raw[0], int):  # validated: the first item says the prompt's shape (models.PromptInput)
        items = [list(raw)]  # one prompt of token ids
    else:
        items = list(raw)
    keep = truncation(req, max_model_len)
    limit = None if keep is not None else max_model_len  # a prompt to be cut may be longer than the context
    prompts = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            prompt = Prompt(tokenize(tokenizer, item, limit, param, req.add_special_tokens), item)
        else:
            if limit is not None and len(item) >= limit:
                raise context_exceeded(limit, len(item), param)  # before looking at every id
            prompt = Prompt(list(item), None)
        if keep is not None and len(prompt.tokens) > keep:
            prompt = Prompt(prompt.tokens[-keep:], None)  # echo shows the tokens kept, decoded
        check_tokens(prompt.tokens, vocab_size, param)
        prompts.append(prompt)
    return prompts


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content if isinstance(part, TextContentPart))


def _content_parts(content: Any) -> list[dict[str, str]]:
    """A message's content as the chat templates of vision-language processors take it: a list of parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "image"} if isinstance(part, ImageContentPart) else {"type": "text", "text": part.text}
            for part in content]


def _message_dict(message: ChatMessage, parts: bool) -> dict[str, Any]:
    """One message as chat templates read it; a call's arguments as an object (templates ``tojson`` them).

    ``parts``: content as a list of parts, as vision-language processors' templates read it.
    """
    content = _content_parts(message.content) if parts else _message_text(message.content)
    item: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        item["name"] = message.name
    if message.tool_call_id is not None:
        item["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments: Any = json.loads(call.function.arguments)
            except ValueError:
                arguments = call.function.arguments
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        item["tool_calls"] = calls
    return item


def render_chat(messages: list[ChatMessage], tokenizer: Tokenizer, *, tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """Messages rendered with the model's chat template (400 when it has none or cannot render them).

    ``template_kwargs``: a request's ``chat_template_kwargs``, template variables beside the messages;
    the arguments this server sets itself cannot be among them.
    """
    if not getattr(tokenizer, "has_chat_template", True):
        raise bad_request("this model has no chat template: use /v1/completions", param="messages",
                          code="chat_template_missing")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or ()))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets it (use the "
                          "request's own fields)", param=f"chat_template_kwargs.{reserved[0]}")
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message needs add_generation_prompt=false (the answer continues the last "
                          "message instead of opening a new turn)", param="continue_final_message")
    try:
        parts = tokenizer.images is not None  # a vision-language model
        return tokenizer.apply_chat_template([_message_dict(m, parts) for m in messages],
                                             add_generation_prompt=add_generation_prompt, tools=tools,
                                             continue_final_message=continue_final_message, **(template_kwargs or {}))
    except Exception as exc:  # the template may raise on conversations it does not support (jinja errors)
        raise bad_request(f"the model's chat template cannot render these messages: {exc}", param="messages",
                          code="chat_template_error") from None


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer, vocab_size: int | None, max_model_len: int | None,
                tools: list[dict[str, Any]] | None = None) -> Prompt:
    """Messages (and tools) rendered with the model's chat template, then tokenized (the template adds BOS;
    ``add_special_tokens`` adds the tokenizer's on top), cut to its last ``truncate_prompt_tokens`` tokens."""
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    keep = truncation(req, max_model_len)
    text = render_chat(req.messages, tokenizer, tools=tools, add_generation_prompt=req.add_generation_prompt,
                       continue_final_message=req.continue_final_message, template_kwargs=req.chat_template_kwargs)
    tokens = tokenize(tokenizer, text, None if keep is not None else max_model_len, "messages",
                      add_special_tokens=req.add_special_tokens)
    tokens, images = place_images(tokens, req.messages, tokenizer)
    if keep is not None and len(tokens) > keep:
        if images:
            raise bad_request("truncate_prompt_tokens would cut the images out of this chat: send fewer messages",
                              param="truncate_prompt_tokens")
        tokens, text = tokens[-keep:], None
    prompt = Prompt(tokens, text, images)
    check_tokens(prompt.tokens, vocab_size, "messages")
    return prompt


def place_images(tokens: list[int], messages: list[ChatMessage], tokenizer: Tokenizer) -> tuple[list[int], list[PromptImage]]:
    """A rendered chat's image placeholders expanded for its images (loaded by ``server.images.load_images``,
    which refuses them for text models)."""
    files = [data for message in messages for data in message.image_files()]
    if not files:
        return tokens, []
    try:
        return tokenizer.images.expand(tokens, files)
    except ValueError as exc:
        raise bad_request(f"cannot place the images in the rendered chat: {exc}", param="messages",
                          code="invalid_image") from None


def resolve_max_tokens(prompt_len: int, requested: int | None, default: int | None, max_model_len: int | None,
                       *, prompt_param: str, tokens_param: str) -> int:
    """Tokens to generate: the request's (checked against the context) or the endpoint's default.

    ``default=None`` means "the rest of the context window" (chat completions).
    """
    if max_model_len is None:
        if requested is not None:
            return requested
        return default if default is not None else 2**31 - 1
    if prompt_len >= max_model_len:
        raise context_exceeded(max_model_len, prompt_len, prompt_param)
    room = max_model_len - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                            f"completion). Please reduce {tokens_param} to at most {room}, or shorten the prompt.",
                       param=tokens_param, code="context_length_exceeded")
    return requested


_PARAM_NAMES = {"num_tokens_to_generate": "max_tokens", "stop_words": "stop", "top_n_logprobs": "logprobs"}


def controls(req: _SamplingRequest, vocab_size: int | None, constraint: StructuredOutputsParams | None,
             prompt_log_probs: bool = False) -> dict[str, object]:
    """The ``SamplingParams`` fields of a request that are checked against the model (token ids of its vocabulary),
    its output constraint and prompt scoring (the copied fields: see ``sampling_params``; their token-id lists are
    checked here)."""
    for row in _TOKEN_ID_ROWS:
        _token_ids(row.http, getattr(req, row.http), vocab_size)  # type: ignore[arg-type] - copied rows have one
    return {
        "logit_bias": _logit_bias(req, vocab_size),
        "stop_token_ids": _token_ids("stop_token_ids", req.stop_token_ids, vocab_size),
        "structured_outputs": constraint,
        "return_prompt_log_probs": prompt_log_probs,
    }


def sampling_params(req: _SamplingRequest, *, max_tokens: int, logprobs: bool, top_logprobs: int,
                    choice: int, defaults: GenerationDefaults,
                    extra: dict[str, object] | None = None, memo: ParamsMemo | None = None) -> SamplingParams:
    """The engine's ``SamplingParams`` for choice number ``choice`` (its ``sample_index``: one seed, a stream per choice).

    The fields the table marks copied (``wire/sampling_fields.py``: temperature, top_k, min_p, the penalties,
    seed, ...) are the request's own, as the table converts them; one the request leaves out takes the model's
    default (``defaults``, from its ``generation_config.json``), else ``SamplingParams``' own, which are OpenAI's.
    ``extra``: the token-id fields and output constraint (see ``controls``). ``memo``: parameters built before
    for the same values, copied instead of validated again (:class:`~.params_memo.ParamsMemo`).
    """
    fields = {
        **copied_from_http(req),
        "num_tokens_to_generate": max_tokens,
        "stop_words": stop_list(req.stop),
        "return_log_probs": logprobs,
        "top_n_logprobs": top_logprobs,
        "sample_index": choice,
        **(extra or {}),
    }
    try:
        return defaults.sampling_params(**fields) if memo is None else memo.sampling_params(defaults, fields)
    except SamplingParamError as exc:  # SamplingParams names its own field; name OpenAI's instead
        param = _PARAM_NAMES.get(exc.field, exc.field)
        raise bad_request(exc.naming(param), param=param) from None


def make_jobs(prompts: list[Prompt], n: int, params_for: Any) -> list[EngineJob]:
    """``n`` jobs per prompt, numbered the way OpenAI numbers choices (prompt-major)."""
    jobs = []
    for p, prompt in enumerate(prompts):
        for c in range(n):
            jobs.append(EngineJob(index=p * n + c, prompt_index=p, prompt=prompt, params=params_for(prompt, c)))
    return jobs
