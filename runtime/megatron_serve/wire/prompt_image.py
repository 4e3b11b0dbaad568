"""One image of a prompt as every process carries it: the encoded file and, once placed, the run of placeholder
tokens it fills (the model's processor that places it is :mod:`megatron_serve.multimodal`'s). Here, beneath the
request types that hold it (:mod:`.request`), so that the wire imports nothing above it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptImage:
    """One image of a prompt: the encoded file and, once placed, the run of placeholder tokens it fills."""

    data: bytes
    offset: int | None = None  # first placeholder token of its run in the prompt (None: not placed yet)
    length: int = 0  # placeholder tokens in the run
    _hash: int | None = field(default=None, repr=False, compare=False)

    @property
    def placed(self) -> bool:
        return self.offset is not None

    @property
    def content_hash(self) -> int:
        """64-bit BLAKE2 digest of the file (stable across processes, unlike ``hash``)."""
        if self._hash is None:
            self._hash = int.from_bytes(hashlib.blake2b(self.data, digest_size=8).digest(), "little")
        return self._hash

    @property
    def cache_key(self) -> int:
        """The value that stands for each of its placeholder tokens in prefix-cache keys: negative, so it
        never equals a token id, and a function of the content only."""
        return -1 - (self.content_hash >> 2)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"data": self.data}
        if self.offset is not None:
            wire.update(offset=self.offset, length=self.length)
        return wire
