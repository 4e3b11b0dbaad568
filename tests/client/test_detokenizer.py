"""Incremental detokenization equals decoding the whole output, token by token, for byte-level and
SentencePiece-style (Metaspace) tokenizers, with multi-byte characters split over tokens."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from megatron_serve.client.detokenizer import IncrementalDetokenizer, token_texts
from megatron_serve.model.tiny import train_tokenizer
from megatron_serve.tokenizer import Tokenizer

TEXTS = [
    "Hello world, the quick brown fox.",
    "naïve café — déjà vu; 東京タワー and 🚀🚀 rockets 👩‍💻!",
    "  leading spaces, trailing \n newlines\n\n and\ttabs ",
    "def add(a, b):\n    return a + b  # 😀",
]


def metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-like BPE (word starts marked with ▁, byte fallback) as Llama 2 and Mistral use."""
    raw = RawTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>", *byte_tokens])
    raw.train_from_iterator([t.replace("🚀", "") for t in TEXTS] * 20, trainer)
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>"), [1])


def byte_level_tokenizer() -> Tokenizer:
    raw = train_tokenizer()
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>"), [])


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer(request) -> Tokenizer:
    return byte_level_tokenizer() if request.param == "byte_level" else metaspace_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_text_equals_decoding_everything(tokenizer, text):
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) > 5
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    streamed = ""
    for count in range(1, len(tokens) + 1):
        detokenizer.update(tokens[:count])
        assert detokenizer.text == tokenizer.decode(tokens[:count])  # every step, not just at the end
        streamed += detokenizer.take_new_text(final=count == len(tokens))
        assert "\ufffd" not in streamed  # a character split over tokens is never streamed half-made
    assert streamed == tokenizer.decode(tokens)


def test_a_continuation_resumes_from_its_earlier_tokens(tokenizer):
    tokens = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    detokenizer.update(tokens[:7])  # what an engine does for a request that already generated 7 tokens
    for count in range(8, len(tokens) + 1):
        detokenizer.update(tokens[:count])
    assert detokenizer.text == tokenizer.decode(tokens)


def test_stop_word_spanning_tokens_trims_the_text(tokenizer):
    tokens = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, ["brown"])
    for count in range(1, len(tokens) + 1):
        if detokenizer.update(tokens[:count]):
            break
    assert detokenizer.text == "Hello world, the quick "


@pytest.mark.parametrize("text", TEXTS)
def test_token_texts_concatenate_to_the_text_with_special_tokens_and_trims(tokenizer, text):
    special = min(tokenizer.special_token_ids)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    tokens = tokens[:3] + [special] + tokens[3:] + [special]
    whole = tokenizer.decode(tokens)
    texts = token_texts(tokenizer, tokens, whole)
    assert len(texts) == len(tokens) and "".join(texts) == whole
    assert texts[3] == "" and texts[-1] == ""  # special tokens add nothing to the text
    assert any(t != tokenizer.token_text(token) for t, token in zip(texts, tokens))  # not a per-token decode
    trimmed = whole[: len(whole) // 2]  # what a stop string leaves
    texts = token_texts(tokenizer, tokens, trimmed)
    assert len(texts) == len(tokens) and "".join(texts) == trimmed and texts[-1] == ""


def test_a_split_character_is_listed_with_the_token_that_completes_it():
    tokenizer = byte_level_tokenizer()  # (the Metaspace one here marks its byte tokens special: decoding drops them)
    tokens = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(tokens) > 1  # split over byte tokens
    assert token_texts(tokenizer, tokens, "🚀") == [""] * (len(tokens) - 1) + ["🚀"]
    partial = IncrementalDetokenizer(tokenizer, token_texts=True)
    partial.update(tokens[:-1])
    assert partial.listable(0) == len(tokens) - 2  # the last one may still take the character


@pytest.mark.parametrize("text", [TEXTS[0], TEXTS[2]])  # (the Metaspace one's byte tokens are special here)
def test_without_skipping_special_tokens_their_text_is_in_the_output(tokenizer, text):
    special = min(tokenizer.special_token_ids)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    tokens = [special, *tokens[:4], special, *tokens[4:], special]
    for skip in (True, False):
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        for count in range(1, len(tokens) + 1):
            detokenizer.update(tokens[:count])
            assert detokenizer.text == tokenizer.decode(tokens[:count], skip_special_tokens=skip)
    assert tokenizer.token_text(special) in detokenizer.text  # the last run did not skip them


def test_include_stop_str_ends_the_text_after_it_and_holds_nothing_back(tokenizer):
    tokens = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    kept = IncrementalDetokenizer(tokenizer, ["brown"], include_stop_str_in_output=True)
    cut = IncrementalDetokenizer(tokenizer, ["brown"])
    streamed = ""
    for count in range(1, len(tokens) + 1):
        stopped = kept.update(tokens[:count])
        assert cut.update(tokens[:count]) == stopped
        if stopped:
            break
        streamed += kept.take_new_text(final=False)
        assert streamed == kept.text.rstrip("\ufffd")  # nothing held back for a possible stop string
    assert kept.text == "Hello world, the quick brown" and cut.text == "Hello world, the quick "
    assert streamed + kept.take_new_text(final=True) == kept.text


def test_the_stop_string_that_ends_first_ends_the_text(tokenizer):
    tokens = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, ["quick brown fox", "brown"])
    assert any(detokenizer.update(tokens[:count]) for count in range(1, len(tokens) + 1))
    assert detokenizer.text == "Hello world, the quick "  # "brown" ends first (both may end in one token)
    detokenizer = IncrementalDetokenizer(tokenizer, ["wn", "own fox"], include_stop_str_in_output=True)
    assert any(detokenizer.update(tokens[:count]) for count in range(1, len(tokens) + 1))
    assert detokenizer.text == "Hello world, the quick brown"


def test_a_token_decoded_on_its_own_is_kept_as_decoding_it_gives(tokenizer):
    for skip in (True, False):
        for token in range(tokenizer.vocab_size):
            assert tokenizer.decode_one(token, skip) == tokenizer.decode([token], skip_special_tokens=skip)
            assert tokenizer.decode_one(token, skip) == tokenizer.decode([token], skip_special_tokens=skip)  # kept


def _run(detokenizer: IncrementalDetokenizer, tokens: list[int], sizes: list[int]) -> list[tuple]:
    """What a detokenizer shows at each delta of ``sizes`` tokens: its text, the streamed piece, the listing."""
    seen, shown = 0, []
    for size in sizes:
        seen = min(len(tokens), seen + size)
        detokenizer.update(tokens[:seen])
        final = seen == len(tokens)
        listed = detokenizer.listable(detokenizer.emitted) if detokenizer.ends is not None else None
        shown.append((detokenizer.text, detokenizer.take_new_text(final=final), listed, list(detokenizer.ends or [])))
        if final:
            return shown
    raise AssertionError("sizes too short")


def test_a_byte_level_tokenizer_adds_each_token_s_own_text_and_shows_what_its_windows_show():
    """Byte-level BPE is concatenative: a token after whole characters adds its own text, kept per id (no decoding),
    and everything shown (texts, pieces, listings) is what decoding each window shows, for random ids (a quarter of
    them bytes of split characters), special tokens skipped or not, deltas of one or several tokens."""
    import random

    tokenizer = byte_level_tokenizer()
    assert tokenizer.concatenative and not metaspace_tokenizer().concatenative
    rng = random.Random(0)
    special = sorted(tokenizer.special_token_ids)
    total = 0

    class Counted(IncrementalDetokenizer):
        windows = 0

        def _decode_window(self, new_tokens):
            Counted.windows += 1
            super()._decode_window(new_tokens)
    for case in range(60):
        tokens = [rng.choice(special) if rng.random() < 0.05 else rng.randrange(tokenizer.vocab_size)
                  for _ in range(rng.randrange(1, 40))]
        sizes = [rng.choice([1, 1, 1, 2, 3]) for _ in tokens]
        skip, listing = case % 2 == 0, case % 3 == 0
        short = Counted(tokenizer, skip_special_tokens=skip, token_texts=listing)
        window = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, token_texts=listing)
        window._texts = None  # the control: every token through a decoded window
        shown = _run(short, tokens, sizes)
        assert shown == _run(window, tokens, sizes)
        assert shown[-1][0] == tokenizer.decode(tokens, skip_special_tokens=skip)
        total += len(tokens)
    assert Counted.windows < total / 2  # most tokens took the short way


def test_a_byte_level_tokenizer_reads_split_characters_as_their_bytes_without_a_window():
    """A character split over tokens is read from their bytes (UTF-8, invalid bytes as U+FFFD, as the decoder reads
    them): no window is decoded for tokens of the vocabulary, and everything shown is what decoding the windows shows,
    for random bytes (most of them invalid or incomplete sequences) and for texts of multi-byte characters. An added
    token in the window (its text shown: special tokens not skipped) takes the window."""
    import random

    from megatron_serve.client.token_bytes import token_bytes

    tokenizer = byte_level_tokenizer()
    table = token_bytes(tokenizer)
    single = {raw[0]: t for t in range(tokenizer.vocab_size) if (raw := table.get(t)) is not None and len(raw) == 1}
    assert len(single) == 256 and all(table.get(t) is None for t in tokenizer.special_token_ids)
    rng = random.Random(1)

    class Counted(IncrementalDetokenizer):
        windows = 0

        def _decode_window(self, new_tokens):
            Counted.windows += 1
            super()._decode_window(new_tokens)

    cases = [[single[b] for b in rng.randbytes(rng.randrange(1, 12))] for _ in range(300)]
    cases += [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    for tokens in cases:
        sizes = [rng.choice([1, 1, 2, 3]) for _ in tokens]
        shown = _run(Counted(tokenizer), tokens, sizes)
        window = IncrementalDetokenizer(tokenizer)
        window._texts = None  # the control: every token through a decoded window
        assert shown == _run(window, tokens, sizes)
        assert shown[-1][0] == tokenizer.decode(tokens)
    assert Counted.windows == 0
    special = sorted(tokenizer.special_token_ids)[0]
    tokens = [single[0xE6], single[0x9D], special, single[0xB1], *tokenizer.encode("東京", add_special_tokens=False)]
    shown = _run(Counted(tokenizer, skip_special_tokens=False), tokens, [1] * len(tokens))
    window = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    window._texts = None
    assert shown == _run(window, tokens, [1] * len(tokens)) and Counted.windows > 0
    assert shown[-1][0] == tokenizer.decode(tokens, skip_special_tokens=False)


def test_a_sentencepiece_tokenizer_is_not_concatenative_its_tokens_text_depends_on_their_neighbours():
    tokenizer = metaspace_tokenizer()
    tokens = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    forced = IncrementalDetokenizer(tokenizer)
    forced._texts = tokenizer.single_texts(True)  # the negative control: the short way where it does not hold
    for count in range(1, len(tokens) + 1):
        forced.update(tokens[:count])
    assert forced.text != tokenizer.decode(tokens)  # word-start markers lose their spaces
