"""Incremental detokenization with stop strings, so streamed text never shows what the final text trims.

It runs where the text is wanted (the client side: :mod:`megatron_serve.client.output_processor`), never on
an engine's step thread.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Iterable, Sequence

from ..tokenizer import Tokenizer
from .token_bytes import token_bytes


class IncrementalDetokenizer:
    """Tracks a request's text and how much of it was already emitted.

    Each new token is decoded in a short window with the visible token before it, and its text is
    the window's text past that token's (decoding the whole output every step would cost O(length)
    per token). The window keeps what depends on neighbours right: a word-start marker becomes a
    space after the first token, and bytes of one UTF-8 character split over tokens join up; until
    they do, the pending text ends in U+FFFD and the window stays open. With
    ``skip_special_tokens`` (vLLM's default) special tokens render as nothing, so they never enter a
    window (a window starting at one would lose a leading space); without it they render as their
    text, like any other token.

    Stop strings: the text ends where the first of them (the one that ends first) appears, before it
    or, with ``include_stop_str_in_output``, after it. Text that may still turn into a stop string
    (the last ``len(longest) - 1`` characters, when stop strings are cut off) or that ends in an
    incomplete UTF-8 sequence is held back until it is safe, so streamed text never shows what the
    final text trims.

    ``token_texts`` (log-prob listings): tokens are decoded one window each, and the length of the
    text each one makes final is kept, so that every token's share of the text is known without a
    second decoding (:meth:`listable`, :meth:`texts`). Decoding a token on its own is not its share:
    a special token is in no text, a character split over tokens shows as U+FFFD in each, a
    word-start marker loses its space at the start of a decode, and a stop string trims tokens away.
    Here a token's text is the empty string for special tokens, for the first bytes of a split
    character (the token that completes it carries it) and for tokens past a stop string; the texts
    of all tokens concatenate to the text, and no offset passes its end.
    """

    __slots__ = ("tokenizer", "stop_words", "include_stop", "holdback", "emitted", "ends", "_skip_special",
                 "_special", "_texts", "_seen", "_visible", "_prefix_offset", "_read_offset", "_done", "_done_length",
                 "_joined", "_joined_count", "_pending_text", "_final_text", "_sent_piece", "_sent_start", "_checked",
                 "_stop_floor", "_incomplete", "_bytes", "_pending_raw")

    def __init__(self, tokenizer: Tokenizer, stop_words: Sequence[str] = (), *, skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False, token_texts: bool = False):
        self.tokenizer = tokenizer
        self.stop_words = list(stop_words)
        self.include_stop = include_stop_str_in_output
        longest = max((len(word) for word in self.stop_words), default=1)
        self.holdback = 0 if include_stop_str_in_output else longest - 1
        self.emitted = 0  # characters of the text taken (take_new_text)
        self._skip_special = skip_special_tokens
        self._special = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        # A tokenizer whose text is its tokens' texts joined (Tokenizer.concatenative): a token after a run that ended
        # on whole characters adds its own text, kept per id: no window to decode (see _window)
        self._texts = tokenizer.single_texts(skip_special_tokens) if tokenizer.concatenative else None
        # Its tokens' bytes, and those of the tokens past read_offset (None: not all known): a split character's text is
        # its bytes read as UTF-8, no window to decode (see _window)
        self._bytes = token_bytes(tokenizer)
        self._pending_raw: bytes | None = b""
        self._seen = 0  # generated tokens looked at so far
        self._visible: list[int] = []  # the generated tokens that render (special ones too without skipping)
        self._prefix_offset = 0  # window start: the visible token before read_offset, decoded for context
        self._read_offset = 0
        # The text of visible[:read_offset], final, as the pieces it was made in: a piece joins the text when the
        # text is read, not per token (joining it to the text so far copied the whole text once per token)
        self._done: list[str] = []
        self._done_length = 0
        self._joined = ""  # the first _joined_count pieces, joined
        self._joined_count = 0
        self._pending_text = ""  # what the tokens past read_offset add (it ends in U+FFFD: an incomplete character)
        self._final_text: str | None = None  # the text once a stop string ended it
        self._sent_piece = 0  # without stop strings: the first piece not taken whole, and where it starts
        self._sent_start = 0
        self._checked = 0  # committed characters already searched for stop strings
        self._stop_floor = 0  # stop words must end past this (text made while min_tokens held them off)
        # With token_texts: per token, the length of the text that is final once it is decoded
        self.ends: list[int] | None = [] if token_texts else None
        self._incomplete = False  # the last token leaves an incomplete character (it takes it if it stays last)

    @property
    def text(self) -> str:
        """The text so far (trimmed where a stop string ended it)."""
        if self._final_text is not None:
            return self._final_text
        return self._committed() + self._pending_text

    def _committed(self) -> str:
        """The final text (of ``visible[:read_offset]``), its pieces joined."""
        done = self._done
        if self._joined_count != len(done):
            self._joined += "".join(done[self._joined_count:])
            self._joined_count = len(done)
        return self._joined

    def append(self, new_tokens: Sequence[int]) -> None:
        """Decode ``new_tokens`` (with ``token_texts``, one window each, keeping each one's end)."""
        ends = self.ends
        if ends is None or not new_tokens:
            self._window(new_tokens)
            return
        for token in new_tokens:  # one window per token: each one's share of the text is known
            self._window((token,))
            ends.append(self._done_length)
            self._incomplete = bool(self._pending_text)

    def _window(self, new_tokens: Iterable[int]) -> None:
        """Decode the window the new tokens end (see the class docstring).

        The window's context is most often the one token before the new ones, whose text alone the tokenizer
        keeps (:meth:`~megatron_serve.tokenizer.Tokenizer.decode_one`): one decoding per token instead of two.
        A concatenative tokenizer's token that comes when nothing is pending adds its own text and moves the
        window past itself, as decoding the window would (the text is the same whatever the windows); one that
        leaves an incomplete character, and the tokens after it until one completes it, are read as their bytes
        (:mod:`.token_bytes`: the window's text, as its decoder makes it, since the text before the window ends on a
        whole character), or take the window when one of them has no bytes of its own (an added token).
        """
        texts = self._texts
        if texts is None:
            self._decode_window(new_tokens)
            return
        visible, special, done = self._visible, self._special, self._done
        for token in new_tokens:
            if token in special:
                continue
            if self._read_offset == len(visible):  # nothing pending
                text = texts.get(token)
                if text is None:
                    text = self.tokenizer.decode_one(token, self._skip_special)
                if not text.endswith("\ufffd"):
                    visible.append(token)
                    self._prefix_offset = self._read_offset
                    self._read_offset += 1
                    done.append(text)
                    self._done_length += len(text)
                    continue
            raw = None if self._pending_raw is None or self._bytes is None else self._bytes.get(token)
            if raw is None:
                self._decode_window((token,))
                continue
            visible.append(token)
            raw = self._pending_raw + raw
            self._pend(raw.decode("utf-8", "replace"))
            if self._pending_text:
                self._pending_raw = raw

    def _decode_window(self, new_tokens: Iterable[int]) -> None:
        """:meth:`_window` by decoding the window."""
        visible, special, tokenizer = self._visible, self._special, self.tokenizer
        for token in new_tokens:  # (a loop: a generator for the one token of a step cost more than its decoding)
            if token not in special:
                visible.append(token)
        skip, start, read = self._skip_special, self._prefix_offset, self._read_offset
        if read - start == 1:
            prefix = tokenizer.decode_one(visible[start], skip)
        else:
            prefix = tokenizer.decode(visible[start:read], skip)
        self._pend(tokenizer.decode(visible[start:], skip)[len(prefix) :])
        if self._read_offset != len(visible):
            self._pending_raw = None  # the bytes of the tokens that stay pending are not known

    def _pend(self, pending: str) -> None:
        """The text of the tokens past ``read_offset``: final, and the window moves past them, unless it ends in an
        incomplete character (U+FFFD) or is empty."""
        if pending and not pending.endswith("\ufffd"):
            self._done.append(pending)
            self._done_length += len(pending)
            self._prefix_offset, self._read_offset = self._read_offset, len(self._visible)
            pending = ""
            self._pending_raw = b""
        self._pending_text = pending

    def update(self, generated_tokens: list[int], check_stop: bool = True) -> bool:
        """Decode the new tokens; returns True when a stop word appeared (the text is then trimmed).

        ``check_stop=False`` (before ``min_tokens``): stop words are not looked for, and one that
        ends in the text made meanwhile never counts later.
        """
        checked = self._checked
        self.append(generated_tokens[self._seen :])
        self._seen = len(generated_tokens)
        self._checked = self._done_length
        if not check_stop:
            self._stop_floor = self._done_length + len(self._pending_text)
        elif self.stop_words:
            text = self.text
            hits = [(i + len(w), i, w) for w in self.stop_words if (i := self._find_stop(text, w, checked)) >= 0]
            if hits:
                end, start, _ = min(hits)
                self._final_text = text[: end if self.include_stop else start]
                return True
        return False

    def extend(self, new_tokens: list[int]) -> None:
        """Decode the tokens that follow those seen so far, with no stop strings to look for (:meth:`update`'s work
        when there are none)."""
        if self.ends is None:
            self._window(new_tokens)
        else:
            self.append(new_tokens)
        self._seen += len(new_tokens)

    def skip(self) -> None:
        """Count the next token without its text: the stop token that ended the request (vLLM leaves it out of the
        text unless ``include_stop_str_in_output``); with ``token_texts`` its share is empty."""
        self._seen += 1
        if self.ends is not None:
            self.ends.append(self._done_length)

    def take_one(self, token: int) -> str:
        """:meth:`extend` with one token, then :meth:`take_new_text` (not final): the new text to show, for a
        detokenizer without stop strings or token texts (a plain stream's one token a step). A token whose text
        its tokenizer keeps, that comes when nothing is pending or untaken, is its text at once; any other takes
        the general way."""
        texts = self._texts
        done = self._done
        if (texts is not None and self._read_offset == len(self._visible) and self._sent_piece == len(done)
                and self.emitted == self._done_length and token not in self._special):
            text = texts.get(token)
            if text is not None and not text.endswith("\ufffd"):
                self._visible.append(token)
                self._prefix_offset = self._read_offset
                self._read_offset += 1
                self._seen += 1
                done.append(text)
                self._sent_piece = len(done)
                self.emitted = self._sent_start = self._done_length = self._done_length + len(text)
                return text
        self.extend([token])
        return self.take_new_text(final=False)

    def plain_texts(self) -> tuple[dict[int, str], frozenset[int]] | None:
        """What a run of plain tokens is read from outside (``OutputCollector.add_plain``): the texts this tokenizer
        keeps by id and the ids that render as nothing, while a token may be read from them alone, as
        :meth:`take_one`'s first way reads it (a concatenative tokenizer, no stop strings or token texts, nothing
        pending or untaken); else None. Until :meth:`absorb` takes the run, nothing here has changed."""
        if (self._texts is None or self.stop_words or self.ends is not None or self._read_offset != len(self._visible)
                or self._sent_piece != len(self._done) or self.emitted != self._done_length):
            return None
        return self._texts, self._special

    def absorb(self, tokens: list[int], text: str) -> None:
        """Take ``tokens`` read from :meth:`plain_texts` since it was asked (each one's kept text, none of them
        special or ending in an incomplete character; ``text``: those texts joined, all of it shown): the state
        :meth:`take_one` leaves after taking each of them, made once for the run."""
        visible, done = self._visible, self._done
        visible.extend(tokens)
        self._prefix_offset, self._read_offset = len(visible) - 1, len(visible)
        self._seen += len(tokens)
        done.append(text)
        self._sent_piece = len(done)
        self.emitted = self._sent_start = self._done_length = self._done_length + len(text)

    def _find_stop(self, text: str, word: str, checked: int) -> int:
        """The first occurrence of ``word`` that ends past the text searched before and the stop floor, or -1."""
        return text.find(word, max(0, max(checked, self._stop_floor) - len(word) + 1))

    def take_new_text(self, final: bool) -> str:
        """The text not emitted yet that is safe to show (all of it when ``final``), counted as emitted."""
        if self.stop_words or self._final_text is not None:
            return self._take(self.text, final)
        # Without stop strings nothing is held back but an incomplete character: the new text is the pieces
        # made since the last take (most often one) and what is pending, read without the text before them
        done, first = self._done, self._sent_piece
        pending = self._pending_text if final else self._pending_text.rstrip("\ufffd")
        if first == len(done):
            text = pending
        elif first == len(done) - 1:
            text = done[first] + pending
        else:
            text = "".join(done[first:]) + pending
        start = self._sent_start
        self._sent_piece, self._sent_start = len(done), self._done_length
        end = start + len(text)
        if end <= self.emitted:
            return ""
        new_text = text[self.emitted - start :]
        self.emitted = end
        return new_text

    def _take(self, text: str, final: bool) -> str:
        """:meth:`take_new_text` from the whole ``text``."""
        end = len(text)
        if not final:
            end -= self.holdback if self.stop_words else 0
            while end > self.emitted and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.emitted:
            return ""
        new_text = text[self.emitted : end]
        self.emitted = end
        return new_text

    def listable(self, length: int) -> int:
        """How many tokens have all of their text within the first ``length`` characters (``token_texts``)."""
        ends = self.ends or []
        count = bisect_right(ends, length)
        return count - 1 if self._incomplete and count == len(ends) else count

    def texts(self, text: str, first: int, last: int, *, final: bool) -> list[str]:
        """The texts of tokens ``first..last-1`` within ``text`` (the text, or what was sent of it).

        ``final``: ``text`` is the whole text, so the last token also takes what is still pending
        (a character left incomplete at the end, shown as U+FFFD in the text).
        """
        ends = self.ends or []
        limit = len(text)
        start = min(ends[first - 1], limit) if first else 0
        out = []
        for i in range(first, last):
            end = limit if final and i == len(ends) - 1 else min(ends[i], limit)
            out.append(text[start:end])
            start = end
        return out


def token_texts(tokenizer: Tokenizer, tokens: list[int], text: str, skip_special_tokens: bool = True) -> list[str]:
    """The text each of ``tokens`` adds to ``text`` (a prompt's, for an echo with log probs; generated
    tokens get theirs from the client's output processor, which decodes them once)."""
    decoder = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens, token_texts=True)
    decoder.append(tokens)
    return decoder.texts(text, 0, len(tokens), final=True)
