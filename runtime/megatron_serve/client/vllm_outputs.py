"""vLLM's result shape, ``RequestOutput`` with a ``CompletionOutput`` per choice, built from the request records.

:class:`~megatron_serve.api.llm.LLM` and ``MegatronAsyncLLM.generate`` (iterated) hand these back,
so that code written for vLLM's ``LLM`` / ``AsyncLLM`` reads ``out.outputs[0].text``,
``out.prompt_token_ids`` and ``out.prompt_logprobs`` unchanged. One record
(:class:`~megatron_serve.wire.request.DynamicInferenceRequest`) per choice stays the one
representation that travels; these are views made once, where the caller reads them, and they
keep the records (``CompletionOutput.request``) with the fields vLLM has no name for beside vLLM's:
the per-token weight epochs, the expert routing, the events and timings.

Log probs are vLLM's: per token a ``{token id: Logprob}`` dict holding the sampled token and the
``logprobs`` most likely ones (the sampled one's ``rank`` is its place among those, ``None`` when it
is not one of them: the engine does not rank the whole vocabulary); ``prompt_logprobs`` starts with
``None`` for the first prompt token (nothing precedes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..tokenizer import Tokenizer
from ..wire.request import DynamicInferenceRequest


@dataclass
class Logprob:
    """vLLM's ``Logprob``: one token's log probability, its rank among the most likely tokens, its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per position, token id -> Logprob (vLLM's ``SampleLogprobs`` / ``PromptLogprobs`` entries).
LogprobsDict = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """vLLM's ``CompletionOutput`` (one choice), plus the record's Megatron fields."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[LogprobsDict] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Megatron's, beside vLLM's: the weights generation that produced each token, the oldest one its KV
    # cache attended to, the experts each processed token was routed to (asked with return_routing_indices).
    policy_epochs: list[int] = field(default_factory=list)
    kv_epochs: list[int] = field(default_factory=list)
    lora_epochs: list[int] = field(default_factory=list)  # the LoRA adapter version of each token (-1: none)
    routing_indices: np.ndarray | None = None
    request: DynamicInferenceRequest | None = None  # the whole record (events, ttft, latency, error)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """vLLM's ``RequestOutput``: one prompt and its ``n`` choices."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[LogprobsDict | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0

    @property
    def requests(self) -> list[DynamicInferenceRequest]:
        """The records of the choices, in ``index`` order (Megatron's result objects)."""
        return [output.request for output in self.outputs if output.request is not None]


class Shaper:
    """Makes vLLM's shapes from records, with one tokenizer (``None``: no token texts, no stop strings found).

    The text of each token (``Logprob.decoded_token``) is decoded once per shaper: with ``logprobs=5`` every
    position names six tokens and the same ones recur, so decoding each one every time was most of the CPU a
    generated token cost (``benchmarks/vllm_llm.py``; docs/design-measurements.md).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def token_text(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.token_text(token)
        return text

    def logprob_entries(self, sampled: Sequence[int], log_probs: Sequence[float], top: Sequence[dict[int, float]]
                        ) -> list[LogprobsDict]:
        """vLLM's per-token dicts: the sampled token first, then the most likely ones, ranked from 1."""
        entries = []
        text = self.token_text
        for position, (token, log_prob) in enumerate(zip(sampled, log_probs)):
            ranked = sorted(top[position].items(), key=lambda item: -item[1]) if position < len(top) else []
            ranks = {candidate: rank for rank, (candidate, _) in enumerate(ranked, start=1)}
            entry = {token: Logprob(float(log_prob), ranks.get(token), text(token))}
            for candidate, value in ranked:
                if candidate != token:
                    entry[candidate] = Logprob(float(value), ranks[candidate], text(candidate))
            entries.append(entry)
        return entries

    def stop_reason(self, record: DynamicInferenceRequest) -> int | str | None:
        """vLLM's ``stop_reason``: the id of ``stop_token_ids`` that ended the choice (the last of its ``token_ids``, as
        in vLLM; a stop string ends the ids at the token that completed it, never a stop id, whose text is not
        searched); else the stop string that ended it, found again in its tokens as the detokenizer found it (the one
        whose first occurrence ends first); ``None`` for the end-of-sequence token and any other end."""
        if record.finish_reason != "stop" or not record.generated_tokens:
            return None
        params = record.sampling_params
        last = record.generated_tokens[-1]
        if last in params.stop_token_ids:
            return last
        if params.stop_words and self.tokenizer is not None:
            text = self.tokenizer.decode(record.generated_tokens, skip_special_tokens=params.skip_special_tokens)
            hits = [(index + len(word), index, word) for word in params.stop_words if (index := text.find(word)) >= 0]
            if hits:
                return min(hits)[2]
        return None

    def completion_output(self, index: int, record: DynamicInferenceRequest) -> CompletionOutput:
        """One choice, finished or not, from its record."""
        asked = record.sampling_params.return_log_probs
        return CompletionOutput(
            index=index,
            text=record.generated_text or "",
            token_ids=list(record.generated_tokens),
            cumulative_logprob=float(sum(record.generated_log_probs)) if asked else None,
            logprobs=self.logprob_entries(record.generated_tokens, record.generated_log_probs,
                                          record.generated_top_n_logprobs) if asked else None,
            finish_reason=None if record.finish_reason is None else str(record.finish_reason),
            stop_reason=self.stop_reason(record),
            policy_epochs=list(record.policy_epochs),
            kv_epochs=list(record.kv_epochs),
            lora_epochs=list(record.lora_epochs),
            routing_indices=record.routing_indices,
            request=record,
        )

    def prompt_logprobs(self, record: DynamicInferenceRequest) -> list[LogprobsDict | None] | None:
        """vLLM's ``prompt_logprobs``: ``None`` first, then a dict per prompt token (``None`` when not asked)."""
        if not record.sampling_params.return_prompt_log_probs:
            return None
        return [None, *self.logprob_entries(record.prompt_tokens[1:], record.prompt_log_probs,
                                            record.prompt_top_n_logprobs)]

    def request_output(self, records: Sequence[DynamicInferenceRequest], *, prompt: str | None = None,
                       request_id: str | None = None) -> RequestOutput:
        """One prompt's ``RequestOutput`` from the records of its ``n`` choices (choice ``i`` is ``records[i]``).

        ``prompt``: the text to report (``chat`` reports its rendered conversation); default the first
        record's. ``request_id``: default the first record's.
        """
        first = records[0]
        return RequestOutput(
            request_id=first.request_id if request_id is None else request_id,
            prompt=first.prompt if prompt is None else prompt,
            prompt_token_ids=list(first.prompt_tokens),
            prompt_logprobs=self.prompt_logprobs(first),
            outputs=[self.completion_output(index, record) for index, record in enumerate(records)],
            finished=all(record.finished for record in records),
            num_cached_tokens=first.cached_tokens,
        )

    def group_by_prompt(self, prompt_indices: Sequence[int], records: Sequence[DynamicInferenceRequest],
                        prompts: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """``RequestOutput``s in prompt order from the records of every choice (``prompt_indices[i]``: the
        prompt of ``records[i]``): vLLM's ``n`` grouping, one result per prompt with ``n`` outputs."""
        groups: dict[int, list[DynamicInferenceRequest]] = {}
        for index, record in zip(prompt_indices, records):
            groups.setdefault(index, []).append(record)
        return [self.request_output(group, prompt=None if prompts is None else prompts[index])
                for index, group in sorted(groups.items())]
