"""A byte-level tokenizer's vocabulary tokens as their bytes, where the client side reads split characters.

A byte-level BPE tokenizer (GPT-2's alphabet: Llama 3, Qwen, the tiny model) writes each byte of a token as one
printable character, and its decoder maps those characters back to bytes and reads all of them as UTF-8, invalid
bytes becoming U+FFFD (:attr:`~megatron_serve.tokenizer.Tokenizer.concatenative`). So the text of tokens that hold a
character split over them is their bytes read as UTF-8, with no decoding call: what
:class:`~.detokenizer.IncrementalDetokenizer` does for them. Added tokens (special or not) are left out: their text is
their content, not bytes of the alphabet, and they take the decoding way.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer


def _alphabet() -> dict[str, int]:
    """The byte-level alphabet, character to byte: printable Latin-1 bytes stand for themselves, the other bytes for the
    characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in set(kept)]
    return {**{chr(b): b for b in kept}, **{chr(256 + n): b for n, b in enumerate(others)}}


_ALPHABET = _alphabet()


class TokenBytes:
    """Per id, a vocabulary token's bytes, made once (None: an added token, or one of characters outside the
    alphabet)."""

    __slots__ = ("_tokenizer", "_added", "_bytes")

    def __init__(self, tokenizer: "Tokenizer") -> None:
        self._tokenizer = tokenizer.hf_tokenizer
        self._added = frozenset(self._tokenizer.added_tokens_decoder)
        self._bytes: dict[int, bytes | None] = {}

    def get(self, token: int) -> bytes | None:
        try:
            return self._bytes[token]
        except KeyError:
            pass
        raw = None
        if token not in self._added:
            piece = self._tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str) and all(c in _ALPHABET for c in piece):
                raw = bytes(_ALPHABET[c] for c in piece)
        self._bytes[token] = raw
        return raw


_BY_TOKENIZER: "weakref.WeakKeyDictionary[Tokenizer, TokenBytes]" = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: "Tokenizer") -> TokenBytes | None:
    """``tokenizer``'s :class:`TokenBytes` (one per tokenizer, shared by its requests); None unless it is byte-level."""
    if not tokenizer.concatenative:
        return None
    found = _BY_TOKENIZER.get(tokenizer)
    if found is None:
        found = _BY_TOKENIZER[tokenizer] = TokenBytes(tokenizer)
    return found
