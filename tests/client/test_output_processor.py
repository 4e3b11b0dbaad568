"""The client side of the output path: token deltas in, text, stop strings and the finished record out.

A stop string ends the request at the token that completed it, whatever the deltas' sizes (an engine
step, a resend after a reconnect); streamed pieces add up to the final text and never show a
half-made character; a request goes on from the tokens it has, whoever sends the next ones.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from megatron_serve.wire.expert_routing import routing_to_wire
from megatron_serve.wire.messages import PromptScores, RoutingRows, TokenDelta
from megatron_serve.client.output_processor import NoTokenizer, OutputCollector, check_params
from megatron_serve.wire.request import FinalRecord, FinishReason, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams

from .test_detokenizer import byte_level_tokenizer

PROMPT = [3, 4, 5]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def deltas(tokens: list[int], sizes: list[int]) -> list[TokenDelta]:
    """``tokens`` cut into deltas of these sizes (cycled), each with log probs, top-2, epochs and expert rows."""
    out, start, i = [], 0, 0
    while start < len(tokens):
        chunk = tokens[start : start + sizes[i % len(sizes)]]
        first_row = 0 if start == 0 else len(PROMPT) + start - 1  # the first step processed the prompt
        rows = np.full((len(PROMPT) + start + len(chunk) - 1 - first_row, 1, 2), start % 7, dtype=np.uint8)
        out.append(TokenDelta(new_tokens=chunk, new_log_probs=[-0.1 * (start + k) for k in range(len(chunk))],
                              top_ids=[[t, 1] for t in chunk], top_log_probs=[[-0.1, -2.0] for _ in chunk],
                              epochs=[[2] * len(chunk), [1] * len(chunk)],
                              routing=RoutingRows(start=first_row, **routing_to_wire(rows))))
        start += len(chunk)
        i += 1
    return out


def run(collector: OutputCollector, items: list[TokenDelta]) -> tuple[str, list[int]]:
    """Feed the deltas until a stop; what a stream showed (text, tokens)."""
    text, tokens = "", []
    for delta in items:
        piece = collector.add(delta)
        text += piece.new_text
        tokens += piece.new_tokens
        assert not piece.new_text.endswith("\ufffd") or collector.stopped  # never half a character mid-stream
        if collector.stopped:
            break
    return text, tokens


@pytest.mark.parametrize("sizes", [[1], [3, 1, 5], [100]])
def test_a_stop_string_ends_the_request_at_the_token_that_completed_it(tokenizer, sizes):
    text = "The quick brown fox jumps over the lazy dog. The end."
    tokens = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(stop_words=["lazy"], return_log_probs=True, top_n_logprobs=2)
    collector = OutputCollector("r", PROMPT, params, tokenizer)
    streamed, streamed_tokens = run(collector, deltas(tokens, sizes))
    assert collector.stopped
    keep = next(k for k in range(1, len(tokens) + 1) if "lazy" in tokenizer.decode(tokens[:k]))
    record = collector.finish_stopped()
    assert record.status is RequestStatus.COMPLETED and record.finish_reason is FinishReason.STOP
    assert record.generated_text == streamed == "The quick brown fox jumps over the "
    assert record.generated_tokens == streamed_tokens == tokens[:keep]
    assert len(record.generated_log_probs) == len(record.generated_top_n_logprobs) == keep
    assert record.policy_epochs == [2] * keep and record.kv_epochs == [1] * keep
    assert len(record.routing_indices) <= len(PROMPT) + keep  # rows of tokens past the stop are dropped
    assert collector.add(TokenDelta(new_tokens=tokens[keep:])).new_tokens == []  # later deltas: dropped
    assert collector.tokens == tokens[:keep]


def test_include_stop_str_in_output_and_min_tokens(tokenizer):
    text = "stop here and stop there"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    min_tokens = len(tokenizer.encode("stop here and", add_special_tokens=False))
    params = SamplingParams(stop_words=["stop"], include_stop_str_in_output=True, min_tokens=min_tokens,
                            num_tokens_to_generate=64)
    collector = OutputCollector("r", PROMPT, params, tokenizer)
    streamed, _ = run(collector, deltas(tokens, [1]))
    assert collector.finish_stopped().generated_text == streamed == "stop here and stop"  # the first one was early


def test_pieces_add_up_to_the_text_whatever_the_deltas_and_a_continuation_goes_on(tokenizer):
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    for trial in range(20):
        tokens = [rng.randrange(vocab) for _ in range(40)]  # random ids: split characters, special tokens
        expected = tokenizer.decode(tokens)
        for sizes in ([1], [rng.randrange(1, 6) for _ in range(5)]):
            collector = OutputCollector("r", PROMPT, SamplingParams(stop_words=["\x00never"]), tokenizer)
            streamed, _ = run(collector, deltas(tokens, sizes))
            tail = collector.tail()
            streamed += tail.new_text if tail is not None else ""
            final = collector.finish(FinalRecord(request_id="r", status=RequestStatus.COMPLETED))
            assert streamed == final.generated_text == expected, (trial, sizes)
            assert final.generated_tokens == tokens and len(final.routing_indices) == len(PROMPT) + len(tokens) - 1


def test_the_final_record_is_completed_with_what_the_deltas_carried(tokenizer):
    tokens = tokenizer.encode("hello there", add_special_tokens=False)
    params = SamplingParams(return_prompt_log_probs=True, top_n_logprobs=1)
    collector = OutputCollector("mine", "a text prompt", params, tokenizer, prompt_tokens=PROMPT)
    first, *rest = deltas(tokens, [1])
    first.cached_tokens = 2
    first.prompt_scores = PromptScores(log_probs=[-1.0, -2.0], top_ids=[[4], [5]], top_log_probs=[[-0.5], [-0.7]])
    collector.add(first)
    for delta in rest:
        collector.add(delta)
    record = FinalRecord(request_id="c1/mine", status=RequestStatus.COMPLETED, finish_reason=FinishReason.LENGTH,
                         cached_tokens=2)  # how it went, and nothing this side has: not its prompt, nor its tokens
    final = collector.finish(record)
    assert final.request_id == "mine" and final.generated_text == "hello there" and final.generated_tokens == tokens
    assert final.prompt == "a text prompt" and final.prompt_tokens == PROMPT and final.sampling_params is params
    assert final.prompt_log_probs == [-1.0, -2.0] and final.prompt_top_n_logprobs == [{4: -0.5}, {5: -0.7}]
    assert final.finish_reason is FinishReason.LENGTH and final.cached_tokens == 2


def test_without_a_tokenizer_text_stays_empty_and_stop_strings_are_refused():
    check_params(SamplingParams(stop_token_ids=[3]), None)
    with pytest.raises(NoTokenizer, match="tokenizer"):
        check_params(SamplingParams(stop_words=["x"]), None)
    collector = OutputCollector("r", PROMPT, SamplingParams(), None)
    assert collector.add(TokenDelta(new_tokens=[7, 8])).new_text == ""
    final = collector.finish(FinalRecord(request_id="r", status=RequestStatus.COMPLETED))
    assert final.generated_tokens == [7, 8] and final.generated_text == ""


@pytest.mark.parametrize("stop", [[], ["o w"]])
@pytest.mark.parametrize("sizes", [[1], [3, 1, 5]])
def test_pieces_list_each_token_once_its_text_is_sent_and_add_up_to_the_final_texts(tokenizer, stop, sizes):
    """With log probs the pieces carry the texts of the tokens a listing may show, never ahead of the text
    sent (a split character or a possible stop string's start holds them back); with the tail they add up
    to the final record's ``generated_token_texts``, which concatenate to its text. Each listed text comes with its
    token's id, log prob and top-n (parallel lists), so that a server renders a chunk from its piece alone. Without
    log probs no piece carries any (the control: nothing is made that nobody reads)."""
    tokens = tokenizer.encode("héllo wörld 🚀 and more", add_special_tokens=False)
    for logprobs in (True, False):
        params = SamplingParams(return_log_probs=logprobs, stop_words=stop)
        collector = OutputCollector("r", PROMPT, params, tokenizer)
        sent, texts, listed = "", [], ([], [], [], [])
        lagged = False

        def take(piece):
            for have, more in zip(listed, (piece.listed_tokens, piece.listed_log_probs, piece.listed_top_ids,
                                           piece.listed_top_log_probs)):
                assert len(more) == len(piece.token_texts)
                have += more

        for delta in deltas(tokens, sizes):
            piece = collector.add(delta)
            sent += piece.new_text
            texts += piece.token_texts
            take(piece)
            lagged |= len(piece.listed_tokens) != len(piece.new_tokens)
            assert "".join(texts) == sent[: len("".join(texts))] and len("".join(texts)) <= len(sent)
            if collector.stopped:
                break
        if not collector.stopped:
            tail = collector.tail()
            if tail is not None:
                sent += tail.new_text
                texts += tail.token_texts
                take(tail)
            final = collector.finish(FinalRecord(request_id="r", status=RequestStatus.COMPLETED))
        else:
            final = collector.finish_stopped()
        if not logprobs:
            assert texts == [] and final.generated_token_texts == [] and listed == ([], [], [], [])
            continue
        assert texts == final.generated_token_texts and len(texts) == len(final.generated_tokens)
        assert listed[0] == final.generated_tokens and listed[1] == final.generated_log_probs and lagged
        assert [dict(zip(*top)) for top in zip(listed[2], listed[3])] == final.generated_top_n_logprobs
        assert "".join(texts) == final.generated_text == sent
        assert any(t == "" for t in texts)  # a split character's first bytes (or tokens past the stop) add nothing


@pytest.mark.parametrize("stop", [[], ["\x00never"]])
@pytest.mark.parametrize("sizes", [[1], [3, 1, 5]])
def test_the_stop_token_is_in_the_ids_and_its_log_probs_not_in_the_text(tokenizer, stop, sizes):
    """vLLM's detokenizer: a delta that ends with the stop token (``stop_token``) keeps it in the ids, with its log
    prob and an empty listed text, and leaves its text out (in with ``include_stop_str_in_output``). Here the stop
    id is an ordinary token (".") whose text would show: the control is the same deltas without the flag."""
    tokens = tokenizer.encode("hello there.", add_special_tokens=False)
    for include, flagged, expected in ((False, True, tokenizer.decode(tokens[:-1])),
                                       (True, True, "hello there."), (False, False, "hello there.")):
        params = SamplingParams(return_log_probs=True, top_n_logprobs=2, stop_words=stop,
                                include_stop_str_in_output=include)
        collector = OutputCollector("r", PROMPT, params, tokenizer)
        items = deltas(tokens, sizes)
        items[-1].stop_token = flagged
        streamed, streamed_tokens = run(collector, items)
        tail = collector.tail()
        streamed += tail.new_text if tail is not None else ""
        final = collector.finish(FinalRecord(request_id="r", status=RequestStatus.COMPLETED,
                                             finish_reason=FinishReason.STOP))
        assert final.generated_tokens == streamed_tokens == tokens and collector.out.stop_token is flagged
        assert streamed == final.generated_text == expected, (include, flagged)
        assert len(final.generated_log_probs) == len(final.generated_token_texts) == len(tokens)
        assert "".join(final.generated_token_texts) == final.generated_text
        assert (final.generated_token_texts[-1] == "") is (flagged and not include)


@pytest.mark.parametrize("given", [False, True], ids=["prompt-only", "prompt-tokens-given"])
def test_the_finished_requests_prompt_is_its_own_list(tokenizer, given):
    prompt = list(PROMPT)
    collector = OutputCollector("r", prompt, SamplingParams(), tokenizer, prompt_tokens=prompt if given else None)
    final = collector.finish(FinalRecord(request_id="r", status=RequestStatus.COMPLETED))
    assert final.prompt_tokens == PROMPT and final.prompt_tokens is not prompt
    text = OutputCollector("t", "hi", SamplingParams(), tokenizer, prompt_tokens=[7, 8])
    assert text.finish(FinalRecord(request_id="t", status=RequestStatus.COMPLETED)).prompt_tokens == [7, 8]
