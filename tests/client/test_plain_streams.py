"""A plain stream (text alone: no stop strings, log probs, listings or kept-ids budget) hands its later tokens' text to
a sink that takes it (``TextSink.put_text``) with no piece made per token, and shows and keeps exactly what whole
pieces show and keep: the text, split where the pieces split it, the ids, the epochs, the result. Every other stream,
and a sink that declines the text alone, gets whole pieces as before."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from megatron_serve.client.detokenizer import IncrementalDetokenizer
from megatron_serve.client.output_processor import OutputCollector
from megatron_serve.client.outputs import StreamPartial
from megatron_serve.client.pending_requests import PendingRequest, PendingRequests
from megatron_serve.wire.accumulator import DeltaAccumulator
from megatron_serve.wire.deltas import TokenDelta
from megatron_serve.wire.request import DynamicInferenceRequest, FinalRecord, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams

from .test_detokenizer import byte_level_tokenizer

PROMPT = [3, 4, 5]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def _ids(tokenizer: Any, seed: int, count: int) -> list[int]:
    """Random ids, a quarter of them bytes of characters split over tokens, a few special ones."""
    rng = random.Random(seed)
    special = sorted(tokenizer.special_token_ids)
    return [rng.choice(special) if rng.random() < 0.03 else rng.randrange(tokenizer.vocab_size) for _ in range(count)]


def _deltas(tokens: list[int]) -> list[TokenDelta]:
    """A step's delta per token, as engines send them: epochs with each, the first with its cached prompt tokens."""
    out = [TokenDelta(new_tokens=[t], epochs=[[i % 3], [i % 5], [-1]]) for i, t in enumerate(tokens)]
    out[0].cached_tokens = 2
    return out


def test_take_one_shows_what_extend_then_take_shows(tokenizer):
    """One token at a time, ``take_one`` gives the piece ``extend`` and ``take_new_text`` give, and leaves the same
    text, for random ids with split characters and special tokens, skipped or not."""
    for case in range(40):
        skip = case % 2 == 0
        one = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        control = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        for token in _ids(tokenizer, case, 60):
            control.extend([token])
            assert one.take_one(token) == control.take_new_text(final=False)
            assert one.text == control.text
        assert one.take_new_text(final=True) == control.take_new_text(final=True)
        assert one.text == tokenizer.decode(_ids(tokenizer, case, 60), skip_special_tokens=skip)


def test_a_plain_delta_is_kept_as_add_keeps_it_and_any_other_is_left_to_add(tokenizer):
    """A plain collector keeps a delta of one id and its epochs in its accumulator's lists itself, as the
    accumulator's ``add`` keeps it; any other delta it leaves, keeping nothing, to :meth:`OutputCollector.add`."""
    plain = TokenDelta(new_tokens=[7], epochs=[[1], [2], [3]])
    collector = OutputCollector("r", PROMPT, SamplingParams(num_tokens_to_generate=16), tokenizer)
    collector.add(TokenDelta(new_tokens=[9], epochs=[[0], [0], [0]]))  # (its first token goes the general way)
    control = DeltaAccumulator()
    control.add(TokenDelta(new_tokens=[9], epochs=[[0], [0], [0]]), "r")
    assert collector.add_plain(plain) is not None
    control.add(plain, "r")
    taken = collector.out
    assert (taken.tokens, taken.policy_epochs, taken.kv_epochs, taken.lora_epochs) == (
        control.tokens, control.policy_epochs, control.kv_epochs, control.lora_epochs)
    others = [TokenDelta(new_tokens=[7, 8], epochs=[[1, 1], [2, 2], [3, 3]]), TokenDelta(new_tokens=[7]),
              TokenDelta(new_tokens=[7], epochs=[[1], [2]]), TokenDelta(new_tokens=[7], epochs=[[1], [2], [3]],
                                                                          new_log_probs=[-0.5]),
              TokenDelta(new_tokens=[7], epochs=[[1], [2], [3]], stop_token=True),
              TokenDelta(new_tokens=[7], epochs=[[1], [2], [3]], cached_tokens=0),
              TokenDelta(new_tokens=[7], epochs=[[1, 1], [2], [3]])]
    for other in others:
        assert collector.add_plain(other) is None
    assert taken.tokens == [9, 7] and taken.policy_epochs == [0, 1]
    collector.add(TokenDelta(new_tokens=[5, 6], epochs=[[4, 4], [5, 5], [6, 6]]))  # the general way, after
    assert collector.add_plain(TokenDelta(new_tokens=[8], epochs=[[7], [8], [9]])) is not None
    assert taken.tokens == [9, 7, 5, 6, 8] and taken.lora_epochs == [0, 3, 6, 6, 9]


class _Sink:
    """A stream's sink that records what it is given; ``texts``: it offers ``put_text`` (and takes the text alone
    when ``takes``)."""

    def __init__(self, texts: bool, takes: bool = True) -> None:
        self.items: list[Any] = []
        self.texts: list[str] = []
        self.shown: list[str] = []  # every text it was given, in order, whichever way it came
        self._takes = takes
        if texts:
            self.put_text = self._put_text

    def put_nowait(self, item: Any) -> None:
        self.items.append(item)
        if isinstance(item, StreamPartial):
            self.shown.append(item.new_text)

    def _put_text(self, text: str) -> bool:
        if self._takes:
            self.texts.append(text)
            self.shown.append(text)
        return self._takes


def _stream(tokenizer: Any, sink: _Sink, tokens: list[int], **params: Any) -> DynamicInferenceRequest:
    """One request streamed into ``sink`` through :class:`PendingRequests`, a delta per token, then its record."""
    loop = asyncio.new_event_loop()
    try:
        sampling = SamplingParams(num_tokens_to_generate=len(tokens), **params)
        pending = PendingRequests()
        pending.add(PendingRequest("r", PROMPT, sampling, True, loop.create_future(),
                                   OutputCollector("r", PROMPT, sampling, tokenizer), sink))
        for delta in _deltas(tokens):
            if pending.on_delta("r", delta) is not None:
                break
        return pending.on_final("r", FinalRecord(request_id="r", status=RequestStatus.COMPLETED))
    finally:
        loop.close()


def test_a_plain_stream_s_later_tokens_come_as_their_text_alone_and_show_and_keep_what_pieces_do(tokenizer):
    for seed in range(6):
        tokens = _ids(tokenizer, 100 + seed, 80)
        sink, control = _Sink(texts=True), _Sink(texts=False)
        result, expected = _stream(tokenizer, sink, tokens), _stream(tokenizer, control, tokens)
        pieces = [item for item in sink.items if isinstance(item, StreamPartial)]
        assert len(pieces) <= 2 and len(sink.texts) == len(tokens) - 1  # the first token whole, a held-back tail maybe
        assert len([item for item in control.items if isinstance(item, StreamPartial)]) >= len(tokens)
        # the same text, cut in the same places (the empty texts of held bytes are nothing to write)
        assert [t for t in sink.shown if t] == [t for t in control.shown if t]
        assert "".join(sink.shown) == result.generated_text == tokenizer.decode(tokens)
        assert result.generated_tokens == expected.generated_tokens == tokens
        assert (result.policy_epochs, result.kv_epochs, result.lora_epochs, result.cached_tokens) == (
            expected.policy_epochs, expected.kv_epochs, expected.lora_epochs, expected.cached_tokens)
        assert sink.items[-1] == result


def test_a_sink_that_declines_the_text_alone_gets_whole_pieces(tokenizer):
    tokens = _ids(tokenizer, 7, 40)
    sink, control = _Sink(texts=True, takes=False), _Sink(texts=False)
    _stream(tokenizer, sink, tokens), _stream(tokenizer, control, tokens)
    assert sink.texts == []
    assert [(p.new_tokens, p.new_text) for p in sink.items[:-1]] == [
        (p.new_tokens, p.new_text) for p in control.items[:-1]]


@pytest.mark.parametrize("params", [{"stop_words": ["zz"]}, {"return_log_probs": True}])
def test_streams_with_stop_strings_or_listings_take_whole_pieces(tokenizer, params):
    tokens = _ids(tokenizer, 9, 30)
    sink = _Sink(texts=True)
    _stream(tokenizer, sink, tokens, **params)
    assert sink.texts == [] and len([item for item in sink.items if isinstance(item, StreamPartial)]) >= 20


def test_a_run_of_plain_tokens_reads_as_the_detokenizer_s_text_whatever_reads_it_mid_run(tokenizer):
    """A plain collector reads a run of tokens from the tokenizer's kept texts and hands the run to its detokenizer
    only when something else reads it: a delta of several ids, the text, the tail, the result. Each of those, at
    any point of a run, finds what the detokenizer would have made token by token."""
    for seed in range(6):
        rng = random.Random(seed)
        tokens = _ids(tokenizer, 300 + seed, 150)
        collector = OutputCollector("r", PROMPT, SamplingParams(num_tokens_to_generate=len(tokens)), tokenizer)
        shown = [collector.add(TokenDelta(new_tokens=tokens[:1], epochs=[[0], [0], [-1]])).new_text]
        taken = 1
        while taken < len(tokens):
            if rng.random() < 0.08:  # a delta of two ids: the general way, maybe in the middle of a run
                ids = tokens[taken:taken + 2]
                shown.append(collector.add(TokenDelta(new_tokens=ids, epochs=[[1] * len(ids), [2] * len(ids),
                                                                              [-1] * len(ids)])).new_text)
                taken += len(ids)
            else:
                text = collector.add_plain(TokenDelta(new_tokens=[tokens[taken]], epochs=[[1], [2], [-1]]))
                assert text is not None
                shown.append(text)
                taken += 1
            if rng.random() < 0.1:
                assert collector.text == tokenizer.decode(tokens[:taken])
                assert collector.text.startswith("".join(shown))
        tail = collector.tail()
        shown.append("" if tail is None else tail.new_text)
        result = collector.finish(FinalRecord(request_id="r", status=RequestStatus.COMPLETED))
        assert "".join(shown) == result.generated_text == tokenizer.decode(tokens)
        assert result.generated_tokens == tokens and len(result.policy_epochs) == len(tokens)
