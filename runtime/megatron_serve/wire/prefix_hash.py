"""Content hashes of complete KV blocks, chained with the parent block's hash.

The same function runs in engines (to find cached blocks) and in the coordinator (to route a
prompt to the group that already holds its prefix), so it must be stable across processes:
a keyed BLAKE2 digest, never Python's ``hash``.

A chain starts from :func:`salted_root`: :data:`ROOT_HASH` for a request without a ``cache_salt``,
else a digest of the salt. The salt so enters the first block's hash and through it every later
one: two requests share cached blocks only when their salts are equal (vLLM's ``cache_salt``), so
one tenant cannot learn from cache timing whether another sent a prompt. Engines and the
coordinator's ``prefix_affinity`` routing both start their chains here, so they agree.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = 0


def salted_root(salt: str | None) -> int:
    """The hash a request's chain of block hashes starts from (see the module docstring)."""
    if not salt:
        return ROOT_HASH
    digest = hashlib.blake2b(salt.encode("utf-8"), digest_size=8, person=b"cache_salt")
    return int.from_bytes(digest.digest(), "little")


def adapter_root(root: int, key: str) -> int:
    """The chain root of a request under the LoRA adapter ``key`` (engines: each registration's own key, so a
    re-registered name never finds the old blocks; the coordinator's routing: the adapter's name), from its
    ``cache_salt`` root: blocks computed under one adapter are never found under another, nor the base model."""
    digest = hashlib.blake2b(root.to_bytes(8, "little") + key.encode("utf-8"), digest_size=8, person=b"lora_adapter")
    return int.from_bytes(digest.digest(), "little")


def epoch_root(root: int, epoch: int) -> int:
    """The chain root of blocks computed under the weights of refit ``epoch``, from a request's root: a refit
    never finds blocks of the weights before it, in any KV tier. The first weights (epoch 0) keep ``root``
    itself, so that a fleet that never refits hashes as the coordinator's routing does."""
    if epoch == 0:
        return root
    digest = hashlib.blake2b(root.to_bytes(8, "little") + epoch.to_bytes(8, "little", signed=True), digest_size=8,
                             person=b"weights_epoch")
    return int.from_bytes(digest.digest(), "little")


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
