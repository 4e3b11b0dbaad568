"""Pydantic models of the OpenAI HTTP API: what requests may hold and what responses promise.

Request models are *strict* in both senses: no ``"1"`` for an integer or ``0`` for a boolean,
and no field that is neither OpenAI's nor one of this server's extensions (listed once, in
``extensions.py``): an unknown field is a 400 that names it, never silently ignored. Static
ranges are field constraints, so that malformed bodies are refused before any work is done and
``/openapi.json`` states exactly what is accepted; the configurable limits (``n``, stop strings,
prompt size, ...) are checked by ``intake.py``.

Response models are what the handlers build and what the OpenAPI document promises; the official
``openai`` client parses them, so field names and nesting follow the OpenAI API exactly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    model_serializer,
)

from .extensions import extension

#: Top log-probabilities per token the engine can return (``SamplingParams.top_n_logprobs``).
MAX_TOP_LOGPROBS = 20
#: Seeds are 64-bit signed integers in the OpenAI API.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

TokenId = Annotated[int, Field(ge=0)]
StopSequence = Annotated[str, Field(min_length=1)]


class _Request(BaseModel):
    """Base of request bodies: strict types, unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="send one last chunk with the usage of the whole request")


class _SamplingRequest(_Request):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: str = Field(description="the served model name (see GET /v1/models)")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="nucleus sampling mass; default 1 (off)")
    top_k: int | None = extension("top_k", ge=-1)
    n: int | None = Field(None, ge=1, description="choices to generate for each prompt")
    stop: StopSequence | list[StopSequence] | None = Field(
        None, description="generation stops before the first of these strings; it is not returned")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="makes sampling repeatable")
    stream: bool | None = Field(None, description="answer with server-sent events ending in 'data: [DONE]'")
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="only 0 is supported")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="only 0 is supported")
    logit_bias: dict[str, float] | None = Field(None, description="not supported; must be empty")
    user: str | None = Field(None, description="accepted and ignored")
    ignore_eos: bool | None = extension("ignore_eos")
    return_epochs: bool | None = extension("return_epochs")


def _prompt_shape(value: Any) -> str:
    """Which of the four prompt shapes ``value`` claims to be, from its first item.

    Choosing the branch up front keeps validation linear: a plain union tries every branch and
    builds one error per item for each that fails (a 500k-id prompt took 270 ms instead of 70).
    """
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str):
            return "list[str]"
        if isinstance(first, list):
            return "list[list[int]]"
        return "list[int]"
    return "str" if isinstance(value, str) else "list[int]"


PromptInput = Annotated[
    Union[
        Annotated[Annotated[str, Field(min_length=1)], Tag("str")],
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1), Tag("list[str]")],
        Annotated[list[TokenId], Field(min_length=1), Tag("list[int]")],
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1), Tag("list[list[int]]")],
    ],
    Discriminator(_prompt_shape),
]


class CompletionRequest(_SamplingRequest):
    """Body of ``POST /v1/completions``."""

    prompt: PromptInput = Field(description="a string, a list of strings, token ids, or a list of token id lists")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate per choice; default 16")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="return log-probs of the chosen tokens and this many alternatives")
    echo: bool | None = Field(None, description="prepend the prompt to each choice's text")
    suffix: str | None = Field(None, description="not supported; must be empty")
    best_of: int | None = Field(None, ge=1, description="only equal to n is supported")


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(_SamplingRequest):
    """Body of ``POST /v1/chat/completions``; messages are rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1,
                                              description="tokens to generate per choice; default: the "
                                                          "rest of the context window")
    logprobs: bool | None = Field(None, description="return the log-prob of each generated token")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="alternatives per token (needs logprobs=true)")
    tools: list[dict] | None = Field(None, description="not supported; must be empty")
    tool_choice: str | dict | None = Field(None, description="accepted when no tools are given")
    response_format: ResponseFormat | None = Field(None, description="only type 'text' is supported")


# ----------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens whose KV blocks came from the prefix cache "
                                              "(not computed again)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


FinishReasonName = Literal["stop", "length"]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class _Epochs(BaseModel):
    """Serializer of the ``return_epochs`` extension fields: left out entirely unless they were asked for."""

    @model_serializer(mode="wrap")
    def _drop_absent_epochs(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in ("policy_epochs", "kv_epochs"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


_POLICY_EPOCHS = "extension (return_epochs): the weights generation (REFIT epoch) that produced each generated token"
_KV_EPOCHS = "extension (return_epochs): the weights generation of the KV cache each generated token attended to"


class CompletionChoice(_Epochs):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    policy_epochs: list[int] | None = Field(None, description=_POLICY_EPOCHS)
    kv_epochs: list[int] | None = Field(None, description=_KV_EPOCHS)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatChoice(_Epochs):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    policy_epochs: list[int] | None = Field(None, description=_POLICY_EPOCHS)
    kv_epochs: list[int] | None = Field(None, description=_KV_EPOCHS)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    """Only the fields a chunk changes: ``{"role": "assistant", "content": ""}`` first, ``{}`` last."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Epochs):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    policy_epochs: list[int] | None = Field(None, description=_POLICY_EPOCHS + " (on the choice's last chunk)")
    kv_epochs: list[int] | None = Field(None, description=_KV_EPOCHS + " (on the choice's last chunk)")


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion (same shape as the full response)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "megatron-serve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body, used for every 4xx and 5xx answer."""

    error: ErrorDetail


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    """Readiness of the fleet behind this server (200 ready, 503 not)."""

    ready: bool
    state: str | None = Field(None, description="lifecycle state: RUNNING, PAUSED, SUSPENDED or STOPPED")
    coordinator_reachable: bool
    engines: int = 0
    detail: str | None = None
