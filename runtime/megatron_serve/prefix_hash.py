"""Content hashes of complete KV blocks, chained with the parent block's hash.

The same function runs in engines (to find cached blocks) and in the coordinator (to route a
prompt to the group that already holds its prefix), so it must be stable across processes:
a keyed BLAKE2 digest, never Python's ``hash``.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = 0


def chain_hash(parent: int, tokens: list[int]) -> int:
    digest = hashlib.blake2b(parent.to_bytes(8, "little") + array("q", tokens).tobytes(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def block_hashes(token_ids: list[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of every complete block of ``token_ids``, each chained with the one before it."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
