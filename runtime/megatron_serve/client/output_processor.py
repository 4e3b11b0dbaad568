"""Where token ids become a request's text: detokenization, stop strings and the finished record.

Engines send token ids only (:class:`~megatron_serve.wire.deltas.TokenDelta`); whoever reads them
makes the text, as vLLM's frontend ``OutputProcessor`` does: the HTTP server's and
``MegatronLLM``'s :class:`~megatron_serve.client.coordinator_client.InferenceClient`, and in direct mode the caller's
event loop (:mod:`megatron_serve.client.local_engine`), never the engine's step thread. One
:class:`OutputCollector` per request accumulates what the deltas carry (tokens, log probs, epochs,
expert rows, prompt scores) and the text; the final record from the engine or coordinator says only how the
request went (``wire.request.FinalRecord``), and :meth:`OutputCollector.finish` builds the public result once,
from that and what this side has (the prompt it sent, the deltas, the text).

Stop strings are found here, token by token: when one appears the request ends at the token that
completed it (:meth:`OutputCollector.finish_stopped`, ``finish_reason`` ``stop``), whoever holds
the collector aborts it where it runs, and tokens generated past it are dropped. Because the text
is made where it is read, a request that moves to another engine (an engine lost, a coordinator
restart) simply goes on from the tokens the collector has: the stream continues at the exact
character it reached.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .detokenizer import IncrementalDetokenizer
from ..wire.accumulator import DeltaAccumulator
from ..wire.deltas import TokenDelta
from .outputs import StreamPartial
from ..wire.request import (DynamicInferenceRequest, EventType, FinalRecord, FinishReason, RequestEvent,
                            RequestStatus)
from ..wire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

logger = logging.getLogger("megatron_serve.client")


def load_tokenizer(given_dir: str | None, offered_dir: str | None) -> "Tokenizer | None":
    """A reader's tokenizer: from the directory it was given (a bad one raises), else from the one the
    coordinator announced when this machine can read it (else None: no text, no stop strings)."""
    from ..tokenizer import Tokenizer, check_tokenizer_files  # noqa: PLC0415 - transformers: only where text is made

    if given_dir is not None:
        return Tokenizer.from_pretrained(given_dir)
    if offered_dir is None:
        return None
    try:
        check_tokenizer_files(offered_dir)  # fast: most often another machine's path
    except OSError:
        logger.info("the coordinator's tokenizer directory %s is not on this machine: results carry no text and "
                    "stop strings are refused (pass tokenizer= to InferenceClient to have them)", offered_dir)
        return None
    try:
        return Tokenizer.from_pretrained(offered_dir)
    except Exception as exc:  # noqa: BLE001 - a client that makes no text still serves token ids
        logger.warning("the coordinator's tokenizer (%s) cannot be loaded here (%s): results carry no text and "
                       "stop strings are refused; pass tokenizer= to InferenceClient", offered_dir, exc)
        return None


class NoTokenizer(ValueError):
    """Stop strings asked of a reader that has no tokenizer to make text with."""


def check_params(params: SamplingParams, tokenizer: "Tokenizer | None") -> None:
    """Refuse what needs text when there is no tokenizer (``add_request`` calls it, before sending)."""
    if tokenizer is None and params.stop_words:
        raise NoTokenizer("stop strings need this client's tokenizer to find them in the text: pass "
                          "InferenceClient(..., tokenizer=...) (a Tokenizer or a directory with tokenizer files), "
                          "or send stop_token_ids instead")


def _top_maps(ids: list[list[int]], log_probs: list[list[float]]) -> list[dict[int, float]]:
    return [dict(zip(i, lp)) for i, lp in zip(ids, log_probs)]


class OutputCollector:
    """One request's outputs as its deltas arrive; ``tokenizer=None`` makes no text (it stays empty)."""

    # (a step reads every stream's: one object each)
    __slots__ = ("request_id", "prompt", "params", "prompt_tokens", "detokenizer", "listed", "out", "arrival_time",
                 "first_token_time", "stopped", "plain", "_ids", "_epochs", "_texts", "_special", "_run")

    def __init__(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                 tokenizer: "Tokenizer | None", prompt_tokens: list[int] | None = None) -> None:
        """``prompt``: as the caller gave it; ``prompt_tokens``: its ids when this process made them (kept as they
        are: a client hands over the copy it made for the SUBMIT, not copied again per request)."""
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.prompt_tokens: list[int] | None = (prompt_tokens if prompt_tokens is not None or isinstance(prompt, str)
                                                else list(prompt))
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, params.stop_words, skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output, token_texts=params.return_log_probs)
        self.listed = 0  # tokens whose texts went out in a piece (token_texts)
        self.out = DeltaAccumulator()  # what the deltas carried, accumulated as the coordinator's mirror does
        self._ids, self._epochs = self.out.plain_lists()  # what add_plain appends a plain delta's id and epochs to
        self.arrival_time = time.time()
        self.first_token_time: float | None = None
        self.stopped = False  # a stop string ended it: later deltas are dropped
        # Its pieces are text alone, with nothing to list or hold back for a stop string: add_plain takes its deltas
        self.plain = self.detokenizer is not None and not params.stop_words and self.detokenizer.ends is None
        # A plain stream's run of tokens read from the tokenizer's kept texts (add_plain): the texts and the ids that
        # render as nothing while the run goes on (else None), and how many of the last tokens it holds, which the
        # detokenizer takes at once when anything else reads it (_settle)
        self._texts: dict[int, str] | None = None
        self._special: frozenset[int] = frozenset()
        self._run = 0

    @property
    def text(self) -> str:
        if self._texts is not None:
            self._settle()
        return "" if self.detokenizer is None else self.detokenizer.text

    @property
    def tokens(self) -> list[int]:
        return self.out.tokens

    def add(self, delta: TokenDelta) -> StreamPartial:
        """Take one delta; the piece it adds to a stream (what is safe to show of the text, the tokens
        up to a stop string). :attr:`stopped` says whether a stop string ended the request in it."""
        if self._texts is not None:
            self._settle()
        if self.stopped:  # only the prompt's facts still count
            self.out.add_rest(delta, 0, self.request_id)
            return StreamPartial(self.request_id, [], "")
        tokens = delta.new_tokens
        detokenizer = self.detokenizer
        # vLLM's detokenizer: the stop token that ended the request is in the ids, not in the text
        unread = 1 if delta.stop_token and tokens and not self.params.include_stop_str_in_output else 0
        read = tokens[:-1] if unread else tokens  # the tokens whose text is made (no copy on the common path)
        if detokenizer is None or not detokenizer.stop_words:  # every token kept (one a step, most often)
            self.out.tokens += tokens
            kept = len(tokens)
            if detokenizer is not None:
                detokenizer.extend(read)
                if unread:
                    detokenizer.skip()
        else:
            kept = self._take_tokens(read)
            if unread and not self.stopped:
                self.out.tokens.append(tokens[-1])
                detokenizer.skip()
                kept += 1
        if kept and self.first_token_time is None:
            self.first_token_time = time.time()
        self.out.add_rest(delta, kept, self.request_id)
        piece = StreamPartial(self.request_id, tokens if kept == len(tokens) else tokens[:kept], "")
        if delta.new_log_probs:
            piece.new_log_probs = delta.new_log_probs[:kept]
        if delta.top_ids is not None and delta.top_log_probs is not None:
            piece.new_top_ids, piece.new_top_log_probs = delta.top_ids[:kept], delta.top_log_probs[:kept]
        if detokenizer is not None:
            piece.new_text = detokenizer.take_new_text(final=self.stopped)
            if detokenizer.ends is not None:
                self._list(piece, final=self.stopped)
        return piece

    def add_plain(self, delta: TokenDelta) -> str | None:
        """Take one delta of a :attr:`plain` collector's stream (after its first token) that carries one id and its
        epochs alone, what most steps bring: the new text it adds (maybe empty), with no piece made. None, having
        taken nothing, for any other delta (:meth:`add` takes it). The id and epochs go to the accumulator's lists,
        held here (:meth:`DeltaAccumulator.plain_lists`).

        A token whose text the tokenizer keeps, after tokens that left nothing pending, is read here from those
        texts (a run): its text is its own, and the detokenizer takes the run's tokens at once when something
        else reads it (:meth:`_settle`). So a plain stream's token reads this collector, its accumulator and the
        tokenizer's texts, not the detokenizer and its two lists (what it saves: docs/benchmarks.md, issue 84)."""
        if not self.plain or self.first_token_time is None:
            return None
        # A delta of one id and its three epochs alone, kept as the accumulator's add keeps it (read here, not there:
        # one object and one call fewer per token)
        if (delta.new_log_probs is not None or delta.top_ids is not None or delta.top_p_token_ids is not None
                or delta.routing is not None or delta.cached_tokens is not None or delta.prompt_scores is not None
                or delta.stop_token):
            return None
        tokens, epochs = delta.new_tokens, delta.epochs
        if len(tokens) != 1 or epochs is None or len(epochs) != 3:
            return None
        policy, kv, lora = epochs
        if len(policy) != 1 or len(kv) != 1 or len(lora) != 1:
            return None
        token = tokens[0]
        self._ids.append(token)
        self._epochs += (policy[0], kv[0], lora[0])
        texts = self._texts
        if texts is not None:
            text = texts.get(token)
            if text is not None and token not in self._special and not text.endswith("\ufffd"):
                self._run += 1
                return text
            self._settle(after=1)
        text = self.detokenizer.take_one(token)
        if text:  # (not while a split character is pending, when it shows nothing) a run may begin with the next
            self._texts, self._special = self.detokenizer.plain_texts() or (None, frozenset())
        return text

    def _settle(self, after: int = 0) -> None:
        """The run's tokens to the detokenizer (:meth:`add_plain`), before anything else reads it; the run ends.
        ``after``: ids kept since the run's last one (the one that ends it)."""
        texts, run = self._texts, self._run
        self._texts, self._run = None, 0
        if run:
            taken = self._ids
            tokens = taken[len(taken) - after - run:len(taken) - after]
            self.detokenizer.absorb(tokens, "".join(map(texts.__getitem__, tokens)))

    def _list(self, piece: StreamPartial, final: bool) -> None:
        """Put in ``piece`` the listing of the tokens a log-prob listing may show now: those whose text was all sent
        (all of them when ``final``), with their texts, ids, log probs and top-n; none without ``return_log_probs``."""
        detokenizer = self.detokenizer
        if detokenizer is None or detokenizer.ends is None:
            return
        first = self.listed
        last = len(detokenizer.ends) if final else max(first, detokenizer.listable(detokenizer.emitted))
        self.listed = last
        sent = detokenizer.text if final else detokenizer.text[: detokenizer.emitted]
        piece.token_texts = detokenizer.texts(sent, first, last, final=final)
        out = self.out
        piece.listed_tokens = out.tokens[first:last]
        piece.listed_log_probs = out.log_probs[first:last]
        piece.listed_top_ids, piece.listed_top_log_probs = out.top_ids[first:last], out.top_log_probs[first:last]

    def _take_tokens(self, tokens: list[int]) -> int:
        """Append ``tokens`` up to the one that completes a stop string; how many were kept."""
        detokenizer, taken = self.detokenizer, self.out.tokens
        min_tokens = self.params.min_tokens
        for kept, token in enumerate(tokens, 1):
            taken.append(token)
            if detokenizer.update(taken, check_stop=len(taken) >= min_tokens):
                self.stopped = True
                return kept
        return len(tokens)

    def tail(self) -> StreamPartial | None:
        """The text held back so far (a possible stop string's start, an unfinished character), at the end."""
        if self._texts is not None:
            self._settle()
        text = "" if self.detokenizer is None else self.detokenizer.take_new_text(final=True)
        piece = StreamPartial(self.request_id, [], text)
        self._list(piece, final=True)
        return piece if text or piece.token_texts else None

    def finish(self, final: FinalRecord) -> DynamicInferenceRequest:
        """The finished request, built once: how it went as its final record says (where it ran), and what it asked
        and what came out as this side has it (the prompt it sent, its text and token ids; what the deltas
        carried)."""
        out = self.out
        request = DynamicInferenceRequest(
            request_id=self.request_id, prompt=self.prompt if isinstance(self.prompt, str) else None,
            prompt_tokens=list(self.prompt_tokens or []), sampling_params=self.params, generated_tokens=out.tokens,
            generated_text=self.text, generated_log_probs=out.log_probs,
            generated_top_n_logprobs=_top_maps(out.top_ids, out.top_log_probs),
            generated_top_p_token_ids=out.top_p_token_ids, policy_epochs=out.policy_epochs,
            kv_epochs=out.kv_epochs, lora_epochs=out.lora_epochs, cached_tokens=final.cached_tokens,
            status=final.status, finish_reason=final.finish_reason, error=final.error, events=list(final.events),
            arrival_time=time.time() if final.arrival_time is None else final.arrival_time,
            first_token_time=final.first_token_time, finish_time=final.finish_time)
        detokenizer = self.detokenizer
        if detokenizer is not None and detokenizer.ends is not None:
            request.generated_token_texts = detokenizer.texts(self.text, 0, len(detokenizer.ends), final=True)
        scores = out.prompt_scores
        if scores is not None and scores.log_probs:
            request.prompt_log_probs = list(scores.log_probs)
            request.prompt_ranks = list(scores.ranks or ())
            if scores.top_ids is not None and scores.top_log_probs is not None:
                request.prompt_top_n_logprobs = _top_maps(scores.top_ids, scores.top_log_probs)
        if out.routing is not None:
            rows = out.routing.array()
            request.routing_indices = rows[: len(request.prompt_tokens) + len(self.tokens)] if request.prompt_tokens \
                else rows
        return request

    def finish_stopped(self) -> DynamicInferenceRequest:
        """The record of a request a stop string ended here (its engine may still run it: abort it)."""
        return self._ended_here(RequestStatus.COMPLETED, FinishReason.STOP, EventType.FINISH, "stop string")

    def finish_over_budget(self, reason: str) -> DynamicInferenceRequest:
        """The record of a request its kept ids' budget ended here, as a coordinator ends one (FAILED, reason
        ``length``, the error naming the budget): the server answers it as a request over a limit."""
        return self._ended_here(RequestStatus.FAILED, FinishReason.LENGTH, EventType.FAIL, reason, error=reason)

    def _ended_here(self, status: RequestStatus, reason: FinishReason, event: EventType, detail: str,
                    error: str | None = None) -> DynamicInferenceRequest:
        now = time.time()
        events = [RequestEvent(EventType.ADD, self.arrival_time)]
        if self.first_token_time is not None:
            events.append(RequestEvent(EventType.FIRST_TOKEN, self.first_token_time))
        events.append(RequestEvent(event, now, detail))
        return self.finish(FinalRecord(
            request_id=self.request_id, status=status, finish_reason=reason, error=error,
            arrival_time=self.arrival_time, first_token_time=self.first_token_time, finish_time=now,
            cached_tokens=self.out.cached_tokens or 0, events=events))
