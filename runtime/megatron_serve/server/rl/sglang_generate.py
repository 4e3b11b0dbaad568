"""SGLang's native ``POST /generate``, as slime, miles and AReaL call a pre-launched SGLang server.

The body is SGLang's ``GenerateReqInput`` (``input_ids`` or ``text``, one prompt or a batch; ``sampling_params`` in
SGLang's names) and the answer SGLang's: ``{text, output_ids, meta_info}`` per sequence (a list for a batch or
``n`` > 1), ``meta_info`` holding ``id``, ``finish_reason`` as ``{type, matched | length | message}``, the token
counts, ``weight_version`` (the weights of the last token, as SGLang reports the version that finished the request)
and ``weight_versions`` (SGLang's per-token spans), ``output_token_logprobs`` as ``[logprob, token_id, text|null]``
with ``return_logprob``, ``routed_experts`` (base64 int32) with ``return_routed_experts``, and, with
``sampling_params.custom_params.return_top_p_token_ids`` (slime's top-p patch of SGLang), ``top_p_token_ids`` and
``top_p_token_offsets`` once finished: the ids each token's filters kept, flat, and where each token's begin (one more
offset than tokens), both base64 int32; a request without top-k, top-p, min-p or typical-p gets neither. A stream
sends SGLang's cumulative events: each holds the whole answer so far. The request runs through ``/v1/completions``' handler
(:func:`.tokens.handler_for`, in :mod:`.token_routes`); this module reads SGLang's body and shapes SGLang's answers.
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, RootModel, model_validator

from ...client.outputs import StreamPartial
from ...wire.request import DynamicInferenceRequest, FinishReason
from ..chunks import event
from ..errors import bad_request
from ..intake import check_budget
from ..streaming import stream_answer
from .sampling_bodies import completions_names, sampling_body
from .tokens import WeightVersionSpan, read_anchor, routed_experts_int32, version_spans, weight_version

if TYPE_CHECKING:  # annotations only: the routes module builds the handlers (token_routes)
    from ..completions import CompletionHandler
    from ..context import ServerContext
    from ..translate import EngineJob

_JSON = msgspec.json.Encoder()
#: SGLang's ``max_new_tokens`` when a request leaves it out.
DEFAULT_MAX_NEW_TOKENS = 128


#: SGLang's output constraints -> the completions field that sets each (SGLang's ``json_schema`` is a schema's text).
CONSTRAINTS = {"json_schema": "guided_json", "regex": "guided_regex", "ebnf": "guided_grammar"}
#: The fields of SGLang's ``sampling_params`` that are no row of the sampling table: its output constraints, and
#: two that are refused unless neutral.
OWN: dict[str, tuple[Any, Any]] = {
    **{name: (str | None, None) for name in CONSTRAINTS},
    "spaces_between_special_tokens": (bool | None, Field(None, description="only false: special tokens' text is "
                                                                           "joined without spaces here")),
    "custom_params": (dict[str, Any] | None, Field(None, description="only return_top_p_token_ids (slime's top-p "
                                                                     "patch of SGLang): true adds top_p_token_ids and "
                                                                     "top_p_token_offsets to meta_info")),
}

SglangSamplingParams = sampling_body(
    "SglangSamplingParams", "sglang", """SGLang's ``sampling_params``: every row of the sampling table with an SGLang
    name (the ranges are those of ``/v1/completions``), its output constraints, and two fields taken only neutral.""",
    descriptions={"max_new_tokens": f"default {DEFAULT_MAX_NEW_TOKENS} (SGLang's)",
                  "no_stop_trim": "keep the stop string at the end of the text"}, own=OWN)


class SglangGenerateRequest(BaseModel):
    """Body of ``POST /generate`` (SGLang's ``GenerateReqInput``: the fields slime, miles and AReaL send)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SglangSamplingParams = Field(default_factory=SglangSamplingParams)
    rid: str | list[str] | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = Field(None, description="-1 (default): no prompt log probs; N: from position N")
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    stream: bool | None = False
    return_routed_experts: bool | None = None
    priority: int | None = None
    log_metrics: bool | None = Field(None, description="accepted: this server's metrics count every request")
    session_id: str | None = Field(None, description="the multi-turn session it belongs to (X-Session-ID wins): kept "
                                                     "on the engine that holds its KV blocks (docs/kv-routing.md)")
    conversation_id: str | None = Field(None, description="accepted: SGLang tracks it, it changes no answer")
    routing_key: str | None = Field(None, description="accepted: SGLang's routing-key policy; the coordinator routes")
    no_logs: bool = Field(False, description="accepted: the request log holds no prompt text anyway")
    custom_labels: dict[str, str] | None = Field(None, description="accepted: SGLang's metric labels, not kept here")

    @model_validator(mode="before")
    @classmethod
    def _neutral_fields(cls, data: Any) -> Any:
        """GenerateReqInput's other fields (:data:`NEUTRAL`): a text request carries them at their neutral value
        (AReaL's backend always sends ``image_data``: ``[]`` in areal 1.0.4, ``null`` at its HEAD 4aef98d), dropped
        here; another value asks for what this route does not do, a 400 naming the field."""
        if not isinstance(data, dict) or not NEUTRAL.keys() & data.keys():
            return data
        kept = {}
        for name, value in data.items():
            if name not in NEUTRAL:
                kept[name] = value
            elif value != NEUTRAL[name][0] and not (value == [] and name in NO_ITEMS):
                raise bad_request(f"{name}: {NEUTRAL[name][1]} is not served by /generate here (send "
                                  f"{json.dumps(NEUTRAL[name][0])} or leave it out)", param=name,
                                  code="unsupported_parameter")
        return kept


#: Multimodal inputs that an empty list leaves empty as ``null`` does (SGLang normalizes both to no items).
NO_ITEMS = frozenset({"image_data", "video_data", "audio_data"})

#: SGLang ``GenerateReqInput`` fields (0.5.23) a text request carries at their neutral value: name -> (that value,
#: what another value asks for).
NEUTRAL: dict[str, tuple[Any, str]] = {
    **{name: (None, "multimodal input") for name in (
        "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "video_config", "modalities",
        "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
        "images_config", "mm_processor_kwargs", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls")},
    "use_audio_in_video": (False, "multimodal input"),
    "input_embeds": (None, "a prompt as embeddings"),
    "positional_embed_overrides": (None, "embedding overrides"),
    "watermark": (None, "watermarking"),
    "token_ids_logprob": (None, "log probs of chosen token ids"),
    "return_sampling_mask": (None, "the sampling support of each token"),
    "sampling_logprobs_mode": (None, "the sampling support of each token"),
    "return_flat_raw_top_logprobs": (False, "flat top log probs"),
    "return_flat_raw_output_top_logprobs": (False, "flat top log probs"),
    "return_flat_raw_top_logprobs_b64": (False, "flat top log probs"),
    "return_hidden_states": (False, "hidden states"),
    "routed_experts_start_len": (0, "routed experts from a later position"),
    "return_indexer_topk": (False, "the sparse-attention indexer's choices"),
    "return_entropy": (False, "entropies"),
    "return_prompt_token_ids": (False, "prompt ids without log probs"),
    "return_bytes": (False, "image generation"),
    "session_params": (None, "SGLang's prompt sessions"),
    "lora_path": (None, "a LoRA adapter by path (a request picks an adapter by /v1/completions' model)"),
    "lora_id": (None, "a LoRA adapter by id"),
    "custom_logit_processor": (None, "a custom logit processor"),
    **{name: (None, "disaggregation bootstrap fields (the coordinator disaggregates itself)") for name in (
        "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
        "disagg_prefill_dp_rank")},
    "routed_dp_rank": (None, "a data-parallel rank (send X-data-parallel-rank to /v1/completions)"),
    "data_parallel_rank": (None, "a data-parallel rank (send X-data-parallel-rank to /v1/completions)"),
    "background": (False, "background responses"),
    "require_reasoning": (False, "required reasoning"),
    "max_thinking_tokens": (None, "a thinking budget"),
    "extra_key": (None, "an extra cache key"),
    "cache_salt": (None, "a cache salt"),
    "kv_hints": (None, "KV hints"),
    "multi_item_delimiter_indices": (None, "multi-item scoring"),
    "token_indices_to_pool": (None, "pooling"),
    "external_trace_header": (None, "trace propagation"),
    "received_time": (None, "an internal timestamp"),
    "http_worker_ipc": (None, "an internal endpoint"),
}


class FinishReasonInfo(BaseModel):
    type: str = Field(description="stop, length or abort")
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class MetaInfo(BaseModel):
    id: str
    finish_reason: FinishReasonInfo | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str | None
    weight_versions: list[WeightVersionSpan]
    output_token_logprobs: list[list[Any]] | None = Field(None, description="[logprob, token_id, text|null] per token")
    output_top_logprobs: list[list[list[Any]]] | None = None
    input_token_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[list[list[Any]] | None] | None = None
    routed_experts: str | None = None
    top_p_token_ids: str | None = Field(None, description="base64 int32: the ids each token's filters kept, flat")
    top_p_token_offsets: str | None = Field(None, description="base64 int32: where each token's kept ids begin, "
                                                              "and their end")


class SglangGenerateResponse(BaseModel):
    """One sequence of ``POST /generate``'s answer (a list of them for a batch or ``n`` > 1)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class SglangGenerateAnswer(RootModel[SglangGenerateResponse | list[SglangGenerateResponse]]):
    """Answer of ``POST /generate``: one sequence, or a list of them (in order, each with its ``index``) for a batch or
    ``n`` > 1."""


#: SGLang's sampling names -> this server's (the others are the same): the table's, and the output constraints'.
_RENAMES = {**completions_names("sglang"), **CONSTRAINTS}
#: This server's completions fields -> where they are in SGLang's body.
NAMES = {"prompt": "input_ids", "logprobs": "top_logprobs_num", "prompt_logprobs": "logprob_start_len",
         "return_routing_indices": "return_routed_experts",
         **{_RENAMES.get(name, name): f"sampling_params.{name}" for name in SglangSamplingParams.model_fields}}


def _prompt(body: SglangGenerateRequest) -> Any:
    """The completions ``prompt`` of ``body``: its ``input_ids`` or its ``text`` (exactly one)."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of input_ids and text", param="input_ids",
                          code="missing_required_parameter" if body.text is None else "conflicting_parameters")
    return body.input_ids if body.input_ids is not None else body.text


def _default_max_new_tokens(ctx: ServerContext, body: SglangGenerateRequest) -> int:
    """SGLang's default, cut to the room the longest prompt of ids leaves in the context (a prompt too long for any
    is refused by the completions handler, naming it)."""
    max_len, ids = ctx.max_model_len(), body.input_ids
    if max_len is None or not ids:
        return DEFAULT_MAX_NEW_TOKENS
    longest = max(map(len, ids)) if isinstance(ids[0], list) else len(ids)
    return min(DEFAULT_MAX_NEW_TOKENS, max(max_len - longest, 1))


def fields(ctx: ServerContext, body: SglangGenerateRequest) -> dict[str, Any]:
    """The ``/v1/completions`` request that runs ``body`` (its fields; :data:`NAMES` says where each came from)."""
    params = body.sampling_params
    if params.spaces_between_special_tokens:
        raise bad_request("sampling_params.spaces_between_special_tokens: special tokens' text is joined without "
                          "spaces here; send false", param="sampling_params.spaces_between_special_tokens",
                          code="unsupported_parameter")
    kept_ids_asked(body)  # refuses other custom parameters, naming them
    given = {_RENAMES.get(name, name): value for name, value in
             params.model_dump(exclude_none=True, exclude={"spaces_between_special_tokens", "custom_params"}).items()}
    given.setdefault("max_tokens", _default_max_new_tokens(ctx, body))
    top = body.top_logprobs_num or 0
    scored = body.logprob_start_len is not None and body.logprob_start_len >= 0
    return {**given, "model": ctx.model_name, "prompt": _prompt(body), "stream": body.stream,
            "logprobs": top if body.return_logprob else None, "prompt_logprobs": top if scored else None,
            "priority": body.priority, "return_routing_indices": body.return_routed_experts,
            "request_id": body.rid if isinstance(body.rid, str) else None}  # /abort_request {rid} finds it by it


def kept_ids_asked(body: SglangGenerateRequest) -> bool:
    """Whether ``body`` asks for each token's kept ids (``custom_params.return_top_p_token_ids``, a bool); any other
    custom parameter (a custom logit processor's) is refused, naming it."""
    custom = body.sampling_params.custom_params or {}
    for name, value in custom.items():
        param = f"sampling_params.custom_params.{name}"
        if name != "return_top_p_token_ids":
            raise bad_request(f"{param}: a custom logit processor's parameter; only return_top_p_token_ids is served",
                              param=param, code="unsupported_parameter")
        if not isinstance(value, bool):
            raise bad_request(f"{param}: must be true or false, got {json.dumps(value)}", param=param)
    return bool(custom.get("return_top_p_token_ids", False))


def _int32_base64(values: list[int]) -> str:
    return base64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode("ascii")


def top_p_fields(result: DynamicInferenceRequest) -> dict[str, str]:
    """``top_p_token_ids`` and ``top_p_token_offsets`` of a finished request (none when no token kept a set: no
    filter), as slime's patch of SGLang encodes them."""
    kept = result.generated_top_p_token_ids
    if not kept:
        return {}
    offsets = np.zeros(len(kept) + 1, dtype=np.int64)
    np.cumsum([len(ids) for ids in kept], out=offsets[1:])
    return {"top_p_token_ids": _int32_base64([token for ids in kept for token in ids]),
            "top_p_token_offsets": _int32_base64(offsets.tolist())}


def _rids(body: SglangGenerateRequest, handler: CompletionHandler) -> list[str]:
    """``meta_info.id`` of each sequence: the request's ``rid`` (one per prompt of a batch), ``_i`` for the ``i``-th
    of ``n``; a fresh id when none is given."""
    prompts = len(handler.prompts)
    if isinstance(body.rid, list):
        rids = body.rid
    else:
        rids = [body.rid] * prompts if body.rid is not None else [uuid.uuid4().hex for _ in range(prompts)]
    if len(rids) != prompts:
        raise bad_request(f"rid holds {len(rids)} ids for {prompts} prompts", param="rid")
    return [rids[job.prompt_index] if handler.n == 1 else f"{rids[job.prompt_index]}_{job.index % handler.n}"
            for job in handler.jobs]


@dataclass
class _SoFar:
    """What one sequence has generated so far (a stream's pieces added up; a whole answer's final record)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    log_probs: list[float] = field(default_factory=list)
    top_n: list[dict[int, float]] = field(default_factory=list)

    def add(self, piece: StreamPartial) -> None:
        self.tokens += piece.new_tokens
        self.text += piece.new_text
        self.log_probs += piece.new_log_probs
        self.top_n += piece.new_top_logprobs

    @classmethod
    def of(cls, result: DynamicInferenceRequest) -> "_SoFar":
        return cls(list(result.generated_tokens), result.generated_text or "", list(result.generated_log_probs),
                   list(result.generated_top_n_logprobs))


class _Shape:
    """SGLang's answer for one request's sequences."""

    def __init__(self, ctx: ServerContext, body: SglangGenerateRequest, handler: CompletionHandler) -> None:
        self.ctx = ctx
        self.body = body
        self.handler = handler
        self.rids = _rids(body, handler)
        batch = isinstance(body.text, list) or (bool(body.input_ids) and isinstance(body.input_ids[0], list))
        self.batched = batch or handler.n > 1  # SGLang answers a list then, one entry per sequence

    def _entry(self, token: int, logprob: float | None) -> list[Any]:
        text = self.ctx.tokenizer.token_text(token) if self.body.return_text_in_logprobs else None
        return [None if logprob is None else float(logprob), token, text]

    def _top(self, alternatives: dict[int, float] | None) -> list[list[Any]]:
        best = sorted((alternatives or {}).items(), key=lambda item: -item[1])[:self.body.top_logprobs_num or 0]
        return [self._entry(t, lp) for t, lp in best]

    def sequence(self, job: EngineJob, so_far: _SoFar, result: DynamicInferenceRequest | None) -> dict[str, Any]:
        """One sequence's answer: ``result`` its final record, None while it streams."""
        meta: dict[str, Any] = {
            "id": self.rids[job.index], "finish_reason": None if result is None else self._finish(job, result),
            "prompt_tokens": len(job.prompt.tokens), "completion_tokens": len(so_far.tokens),
            "cached_tokens": 0 if result is None else result.cached_tokens,
            "weight_version": None, "weight_versions": [],
        }
        if result is not None:
            epochs = list(result.policy_epochs)
            meta["weight_version"] = weight_version(epochs[-1]) if epochs else None
            meta["weight_versions"] = version_spans(epochs)
            if self.body.return_routed_experts:
                meta["routed_experts"] = routed_experts_int32(result)
            meta.update(top_p_fields(result))
        if self.body.return_logprob:
            meta["output_token_logprobs"] = [self._entry(t, lp) for t, lp in zip(so_far.tokens, so_far.log_probs)]
            if self.body.top_logprobs_num:
                meta["output_top_logprobs"] = [self._top(top) for top in so_far.top_n]
            if result is not None and self.handler.req.prompt_logprobs is not None:
                meta.update(self._input_logprobs(result))
        answer = {"text": so_far.text, "output_ids": so_far.tokens, "meta_info": meta}
        if self.batched:
            answer["index"] = job.index
        return answer

    def _input_logprobs(self, result: DynamicInferenceRequest) -> dict[str, Any]:
        """The prompt's log probs from ``logprob_start_len`` on (the first prompt token has none)."""
        start = self.body.logprob_start_len or 0
        scores = [None, *result.prompt_log_probs]
        tops = [None, *result.prompt_top_n_logprobs]
        tokens = result.prompt_tokens
        fields: dict[str, Any] = {"input_token_logprobs": [self._entry(tokens[i], scores[i])
                                                           for i in range(start, len(tokens))]}
        if self.body.top_logprobs_num:
            fields["input_top_logprobs"] = [None if tops[i] is None else self._top(tops[i])
                                            for i in range(start, len(tokens))]
        return fields

    def _finish(self, job: EngineJob, result: DynamicInferenceRequest) -> dict[str, Any]:
        """SGLang's finish reason: ``stop`` with what ``matched`` (the stop token, which ends ``output_ids`` as in
        SGLang, checked first as SGLang checks tokens before strings; else the stop string), ``length`` with the
        tokens generated, ``abort`` with why."""
        reason = result.finish_reason
        if reason is FinishReason.LENGTH:
            return {"type": "length", "length": len(result.generated_tokens)}
        if reason is not FinishReason.STOP:
            return {"type": "abort", "message": result.error or "the fleet ended the request early"}
        params = job.params
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.ctx.tokenizer.eos_token_ids))
        last = result.generated_tokens[-1] if result.generated_tokens else None
        if last in ends:
            return {"type": "stop", "matched": last}
        if params.stop_words:
            text = self.ctx.tokenizer.decode(list(result.generated_tokens), skip_special_tokens=False)
            matched = next((stop for stop in params.stop_words if stop in text), None)
            if matched is not None:
                return {"type": "stop", "matched": matched}
        return {"type": "stop", "matched": None}

    def whole(self, results: list[DynamicInferenceRequest]) -> Any:
        """The whole answer of the finished ``results`` (one per job): a list for a batch or ``n`` > 1."""
        answers = [self.sequence(job, _SoFar.of(result), result) for job, result in zip(self.handler.jobs, results)]
        return answers if self.batched else answers[0]


class _CumulativeEvents:
    """SGLang's stream: every event holds one sequence's whole answer so far; its last one its finish reason."""

    def __init__(self, shape: _Shape) -> None:
        self.shape = shape
        self.so_far: dict[int, _SoFar] = {}

    def item(self, job: EngineJob, item: Any) -> bytes:
        so_far = self.so_far.setdefault(job.index, _SoFar())
        if isinstance(item, StreamPartial):
            if not (item.new_tokens or item.new_text):
                return b""
            so_far.add(item)
            return event(_JSON.encode(self.shape.sequence(job, so_far, None)))
        return event(_JSON.encode(self.shape.sequence(job, so_far, item)))  # the pieces carried every token

    def text_chunks(self, job: EngineJob) -> None:
        """Every event holds the tokens so far: each piece goes whole (:meth:`item`)."""
        return None

    def end(self) -> bytes:
        return b""


def read(raw: bytes) -> SglangGenerateRequest:
    """The body of ``/generate``."""
    return read_anchor(SglangGenerateRequest, raw, "SGLang's GenerateReqInput")


async def answer(ctx: ServerContext, body: SglangGenerateRequest, handler: CompletionHandler) -> Any:
    """Submit ``handler``'s jobs; SGLang's answer, whole or streamed."""
    shape = _Shape(ctx, body, handler)
    if kept_ids_asked(body):
        for job in handler.jobs:
            job.params = msgspec.structs.replace(job.params, return_top_p_token_ids=True)
        check_budget(handler.jobs, ctx.limits)  # kept ids bounded by top_k counted before any work; others as produced
    ctx.request_log.received(handler)
    if body.stream:
        return await stream_answer(ctx.submit(handler.jobs, handler.id), _CumulativeEvents(shape), handler.id)
    results = await ctx.submit(handler.jobs, handler.id).results()
    return Response(_JSON.encode(await ctx.workers.run(shape.whole, results)), media_type="application/json")
