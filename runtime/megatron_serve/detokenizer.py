"""Incremental detokenization with stop words, so streamed text never shows what the final text trims."""

from __future__ import annotations

from .tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Tracks how much of a request's text was already emitted.

    Text that may still turn into a stop word (the last ``len(longest stop word) - 1`` characters)
    or that ends in an incomplete UTF-8 sequence is held back until it is safe.
    """

    def __init__(self, tokenizer: Tokenizer, stop_words: list[str]):
        self.tokenizer = tokenizer
        self.stop_words = stop_words
        self.holdback = max((len(word) for word in stop_words), default=1) - 1
        self.emitted = 0
        self.text = ""

    def update(self, generated_tokens: list[int]) -> bool:
        """Decode the tokens so far; returns True when a stop word appeared (the text is then trimmed)."""
        text = self.tokenizer.decode(generated_tokens)
        if self.stop_words:
            search_from = max(0, self.emitted - self.holdback)
            hits = [i for i in (text.find(w, search_from) for w in self.stop_words) if i >= 0]
            if hits:
                self.text = text[: min(hits)]
                return True
        self.text = text
        return False

    def take_new_text(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            end -= self.holdback if self.stop_words else 0
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.emitted:
            return ""
        new_text = self.text[self.emitted : end]
        self.emitted = end
        return new_text
