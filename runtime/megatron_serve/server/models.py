"""Pydantic models of the OpenAI HTTP API: what requests may hold and what responses promise.

Request models are *strict* in both senses: no ``"1"`` for an integer or ``0`` for a boolean,
and no field that is neither OpenAI's nor one of this server's extensions (listed once, in
``extensions.py``): an unknown field is a 400 that names it, never silently ignored. Static
ranges are field constraints, so that malformed bodies are refused before any work is done and
``/openapi.json`` states exactly what is accepted; the configurable limits (``n``, stop strings,
prompt size, ...) are checked by ``intake.py``. The sampling parameters the server copies into
``SamplingParams`` (temperature, top_k, min_p, the penalties, seed, ...) are declared from their rows of the
table (``wire/sampling_fields.py``: type, range, description), not here.

Response models are what the handlers build and what the OpenAPI document promises; the official
``openai`` client parses them, so field names and nesting follow the OpenAI API exactly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    Tag,
    TypeAdapter,
    create_model,
    model_serializer,
)

from ..wire.placement import MAX_SESSION_ID_CHARS
from ..wire.sampling_fields import COPIED, MAX_TOP_N_LOGPROBS
from .extensions import extension
from .vllm_fields import VllmChatFields, VllmCompletionFields, VllmSamplingFields

TokenId = Annotated[int, Field(ge=0)]
StopSequence = Annotated[str, Field(min_length=1)]


class _Request(BaseModel):
    """Base of request bodies: strict types, unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="send one last chunk with the usage of the whole request")
    continuous_usage_stats: bool = Field(False, description="extension (vLLM's): every chunk carries the usage so "
                                                            "far (with include_usage)")


class JsonSchemaFormat(_Request):
    name: str = Field(description="the schema's name")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema of the output")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _copied_fields() -> type[BaseModel]:
    """The request fields of the sampling parameters the server copies, one per row of the table: its body type (a
    list's items typed) or None, its range (the request's, where it differs from the engine's) and its description
    (an extension's from ``extensions.py``, which lists the rows' own)."""
    fields: dict[str, Any] = {}
    for row in COPIED:
        limits = row.request_bounds.pydantic(row.kind) if row.request_bounds is not None else {}
        info = extension(row.http, **limits) if row.extension else Field(None, description=row.http_doc, **limits)
        fields[row.http] = (Optional[row.body_type], info)
    return create_model("SamplingFields", **fields)


#: The copied sampling parameters' request fields (``wire/sampling_fields.py``), a base of both endpoints' bodies.
SamplingFields = _copied_fields()


class _SamplingRequest(_Request, VllmSamplingFields, SamplingFields):  # type: ignore[misc,valid-type]
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions`` (vLLM's: ``vllm_fields.py``; the sampling
    parameters copied into ``SamplingParams``: :data:`SamplingFields`)."""

    model: str | None = Field(None, description="the served model name (see GET /v1/models); left out: the base "
                                                "model, as vLLM (whose field is optional)")
    n: int | None = Field(None, ge=1, description="choices to generate for each prompt")
    stop: StopSequence | list[StopSequence] | None = Field(
        None, description="generation stops at the first of these strings; it is not returned (unless "
                          "include_stop_str_in_output)")
    stream: bool | None = Field(None, description="answer with server-sent events ending in 'data: [DONE]'")
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="token id (as a string) -> bias added to its logit, -100 to 100")
    stop_token_ids: list[TokenId] | None = extension("stop_token_ids")
    response_format: ResponseFormat | None = Field(None, description="'json_object' or 'json_schema': the output is "
                                                                     "JSON (of that schema)")
    guided_json: dict[str, Any] | str | None = extension("guided_json")
    guided_regex: str | None = extension("guided_regex", min_length=1)
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = extension(
        "guided_choice")
    guided_grammar: str | None = extension("guided_grammar", min_length=1)
    prompt_logprobs: int | None = extension("prompt_logprobs", ge=0, le=MAX_TOP_N_LOGPROBS)
    user: str | None = Field(None, description="accepted and ignored")
    return_epochs: bool | None = extension("return_epochs")
    session_id: str | None = extension("session_id", min_length=1, max_length=MAX_SESSION_ID_CHARS)


def _prompt_shape(value: Any) -> str:
    """Which of the four prompt shapes ``value`` claims to be, from its first item.

    Choosing the branch up front keeps validation linear: a plain union tries every branch and
    builds one error per item for each that fails (a long prompt of ids took four times as long).
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


class CompletionRequest(_SamplingRequest, VllmCompletionFields):
    """Body of ``POST /v1/completions``."""

    prompt: PromptInput = Field(description="a string, a list of strings, token ids, or a list of token id lists")
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate per choice; default 16; 0 scores the "
                                                           "prompt only (with echo or prompt_logprobs, as vLLM)")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_N_LOGPROBS,
                                 description="return log-probs of the chosen tokens and this many alternatives")
    echo: bool | None = Field(None, description="prepend the prompt to each choice's text")
    suffix: str | None = Field(None, description="not supported; must be empty")
    best_of: int | None = Field(None, ge=1, description="only equal to n is supported")


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str = Field(description="a data: URL (base64) or an http(s) URL the server fetches")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted; the model's processor "
                                                                          "decides the resolution")


class ImageContentPart(_Request):
    """An image of a message (vision-language models); once loaded it holds the image file."""

    type: Literal["image_url"]
    image_url: ImageURL
    _file: bytes | None = PrivateAttr(default=None)

    @property
    def file(self) -> bytes:
        if self._file is None:
            raise RuntimeError("image part read before it was loaded (server.images.load_images)")
        return self._file

    def attach(self, data: bytes) -> None:
        self._file = data


ContentPart = Annotated[Union[TextContentPart, ImageContentPart], Field(discriminator="type")]


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments")
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Request):
    name: str
    arguments: str = Field(description="the arguments as a JSON object, in a string")


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    def image_files(self) -> list[bytes]:
        """The loaded files of its image parts (``server.images.load_images`` loads them), in order."""
        if not isinstance(self.content, list):
            return []
        return [part.file for part in self.content if isinstance(part, ImageContentPart)]


class ChatCompletionRequest(_SamplingRequest, VllmChatFields):
    """Body of ``POST /v1/chat/completions``; messages are rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1,
                                              description="tokens to generate per choice; default: the "
                                                          "rest of the context window")
    logprobs: bool | None = Field(None, description="return the log-prob of each generated token")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_N_LOGPROBS,
                                     description="alternatives per token (needs logprobs=true)")
    tools: list[ToolDefinition] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="'auto' (default with tools): the model decides, calls are parsed from its output; "
                          "'required' or a named function: the output is constrained to valid calls; 'none'")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per answer (with "
                                                               "'required': exactly one)")


# ----------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens whose KV blocks came from the prefix cache "
                                              "(not computed again)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


#: ``abort``: vLLM's name for a choice the fleet ended early (a pause in abort mode); it carries the tokens so far.
FinishReasonName = Literal["stop", "length", "tool_calls", "abort"]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(description="per generated token, the text it adds to the choice's text (they "
                                          "concatenate to it); empty for a token that adds none: a special token "
                                          "such as end-of-sequence, a token past a stop string, the first bytes of "
                                          "a character split over tokens")
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(description="where each token's text starts in the choice's text")


class PromptLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs``: one token's log prob at one prompt position."""

    logprob: float
    rank: int | None = Field(None, description="1 = the most likely token at that position (every prompt token "
                                               "has it, in the top n or not, as vLLM's)")
    decoded_token: str | None = None


#: Per prompt position: token id (as a string) -> its entry; the first position has none (null).
PromptLogprobs = list[dict[str, PromptLogprob] | None]
_PROMPT_LOGPROBS = "extension (prompt_logprobs): log probs of the prompt tokens, vLLM's shape"


class _Extensions(BaseModel):
    """Serializer of extension fields (``return_epochs``, ``prompt_logprobs``, ``return_routing_indices``,
    ``return_token_ids``): left out unless asked for."""

    @model_serializer(mode="wrap")
    def _drop_absent_extensions(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in ("policy_epochs", "kv_epochs", "lora_epochs", "prompt_logprobs", "routing_indices",
                    "prompt_token_ids", "token_ids"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


_POLICY_EPOCHS = "extension (return_epochs): the weights generation (REFIT epoch) that produced each generated token"
_KV_EPOCHS = "extension (return_epochs): the weights generation of the KV cache each generated token attended to"
_LORA_EPOCHS = "extension (return_epochs): the LoRA adapter version that produced each generated token (-1: none)"
_ROUTING = ("extension (return_routing_indices): for every processed token of prompt and answer (the last answer "
            "token when generation stopped at its length limit was never processed), for every mixture-of-experts "
            "layer, the ids of the experts it was routed to, most probable first")
RoutingIndices = list[list[list[int]]]
_PROMPT_IDS = "extension (return_token_ids): the prompt's token ids, as the engine ran them (vLLM's name)"
_TOKEN_IDS = "extension (return_token_ids): the generated token ids of this choice (vLLM's name)"
_DELTA_IDS = "extension (return_token_ids): the generated token ids this chunk adds (vLLM's name)"


class CompletionChoice(_Extensions):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description=_PROMPT_LOGPROBS)
    policy_epochs: list[int] | None = Field(None, description=_POLICY_EPOCHS)
    kv_epochs: list[int] | None = Field(None, description=_KV_EPOCHS)
    lora_epochs: list[int] | None = Field(None, description=_LORA_EPOCHS)
    routing_indices: RoutingIndices | None = Field(None, description=_ROUTING + " (streamed: on the choice's last chunk)")
    prompt_token_ids: list[int] | None = Field(None, description=_PROMPT_IDS + " (streamed: on the choice's first "
                                                                            "chunk)")
    token_ids: list[int] | None = Field(None, description=_TOKEN_IDS + " (streamed: those the chunk adds)")


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


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ChatToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ChatToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class ChatChoice(_Extensions):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    policy_epochs: list[int] | None = Field(None, description=_POLICY_EPOCHS)
    kv_epochs: list[int] | None = Field(None, description=_KV_EPOCHS)
    lora_epochs: list[int] | None = Field(None, description=_LORA_EPOCHS)
    routing_indices: RoutingIndices | None = Field(None, description=_ROUTING)
    token_ids: list[int] | None = Field(None, description=_TOKEN_IDS)


class ChatCompletionResponse(_Extensions):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description=_PROMPT_LOGPROBS)
    prompt_token_ids: list[int] | None = Field(None, description=_PROMPT_IDS)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body, used for every 4xx and 5xx answer."""

    error: ErrorDetail


class TokenizeCompletionRequest(_Request):
    """Body of ``POST /tokenize`` for a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (BOS)")
    return_token_strs: bool | None = Field(False, description="also list each token's text")


class TokenizeChatRequest(_Request):
    """Body of ``POST /tokenize`` for a conversation, rendered with the chat template first (vLLM's shape)."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = Field(True, description="end with the assistant's turn opening")
    add_special_tokens: bool = Field(False, description="add special tokens beyond the template's own")
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool | None = Field(False, description="also list each token's text")


def _tokenize_shape(value: Any) -> str:
    return "TokenizeChatRequest" if isinstance(value, dict) and "messages" in value else "TokenizeCompletionRequest"


#: Body of ``POST /tokenize``: a prompt or a conversation, told apart by ``messages`` (one branch's errors only).
TokenizeRequest = TypeAdapter(Annotated[
    Union[Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")],
          Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")]],
    Discriminator(_tokenize_shape),
])


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None = None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    """Body of ``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
