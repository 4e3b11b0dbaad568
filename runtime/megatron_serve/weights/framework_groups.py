"""How RL frameworks lay out the process group a trainer pushes weights over, and what they announce on it.

Both sides read this: the server's weight routes join such a group as its receiving ranks
(:mod:`megatron_serve.server.rl.weight_bridge`), a CPU trainer builds the other side
(:mod:`megatron_serve.client.trainer_group`). No torch here: the HTTP server imports it to check a request before
anything is received.

A group is a ``TCPStore`` at one address, the key prefixes a framework puts in front of it (vLLM's none, SGLang's
``init_custom_process_group``'s, TRL's ``client2server``), the ranks each side takes and which rank sends. Tensors
travel in the order of the names announced, one broadcast each, or packed as vLLM packs them (bytes back to back in
one buffer, cut once it holds more than ``buffer_bytes``, the tensor that crossed the mark included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from ..wire.rendezvous import TRANSFER_BACKENDS, TRANSFER_DTYPES

#: vLLM's packed buffer size (``DEFAULT_PACKED_BUFFER_SIZE_BYTES``): the trainer and the receiver must agree on it.
PACKED_BUFFER_BYTES = 1 << 30
#: TRL's key prefix (its XPU path's ``PrefixStore``).
TRL_PREFIX = "client2server"


def sglang_prefixes(group_name: str, backend: str) -> tuple[str, ...]:
    """The key prefixes of SGLang's ``init_custom_process_group``: the group's name, then torch's own two."""
    return (group_name, f"{group_name}/", "cpu/" if backend == "gloo" else "cuda/")


def dtype_name(name: str) -> str:
    """``"bfloat16"`` for ``"bfloat16"`` or ``"torch.bfloat16"`` (TRL's spelling); ``ValueError`` naming any dtype a
    REFIT cannot carry."""
    plain = name.removeprefix("torch.") if isinstance(name, str) else None
    if plain not in TRANSFER_DTYPES:
        raise ValueError(f"dtype {name!r} cannot travel: weights are one of {', '.join(TRANSFER_DTYPES)}")
    return plain


@dataclass(frozen=True)
class TensorMeta:
    """One tensor the trainer announced before it broadcasts it (``dtype``: a key of ``TRANSFER_DTYPES``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * TRANSFER_DTYPES[self.dtype]


def announced(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[TensorMeta]:
    """The tensors of an update (three lists of one length, as every protocol sends them); ``ValueError`` naming
    what is wrong before any byte is received."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes must have one length, got {len(names)}, {len(dtypes)} and "
                         f"{len(shapes)}")
    if not names:
        raise ValueError("no tensors named: an update carries at least one")
    if len(set(names)) != len(names):
        raise ValueError(f"tensor(s) {sorted({n for n in names if names.count(n) > 1})} named twice")
    metas = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        metas.append(TensorMeta(name, dtype_name(dtype), tuple(shape)))
    return metas


def packed_chunks(metas: Iterable[TensorMeta], buffer_bytes: int) -> list[list[TensorMeta]]:
    """vLLM's packing: tensors join a buffer until it holds more than ``buffer_bytes`` (the one that crossed the
    mark included), then the next buffer starts."""
    chunks: list[list[TensorMeta]] = [[]]
    total = 0
    for meta in metas:
        chunks[-1].append(meta)
        total += meta.nbytes
        if total > buffer_bytes:
            chunks.append([])
            total = 0
    return [chunk for chunk in chunks if chunk]


@dataclass(frozen=True)
class Layout:
    """Where a trainer's group lives and how its side named it: the store's address, the key prefixes in front of
    the group, the ranks the receiving side takes, which rank sends, and whether the receiving side serves the
    store (TRL's server rank 0 does)."""

    host: str
    port: int
    world_size: int
    ranks: tuple[int, ...]
    src: int
    backend: str
    prefixes: tuple[str, ...] = ()
    hosts_store: bool = False

    def __post_init__(self) -> None:
        if self.backend not in TRANSFER_BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {', '.join(TRANSFER_BACKENDS)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is not a TCP port")
        if not self.ranks or self.world_size < 2:
            raise ValueError(f"a trainer's group needs the trainer and a receiver: world_size {self.world_size}")
        taken = {*self.ranks, self.src}
        if len(taken) != len(self.ranks) + 1 or not all(0 <= rank < self.world_size for rank in taken):
            raise ValueError(f"ranks {list(self.ranks)} (receiving) and {self.src} (the trainer) must be distinct "
                             f"ranks of world_size {self.world_size}")

    @classmethod
    def trainer_first(cls, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                      prefixes: tuple[str, ...] = ()) -> "Layout":
        """vLLM's and SGLang's rendezvous: the trainer is rank 0 and serves the store; the receiving side takes the
        ranks from ``rank_offset`` to the last."""
        return cls(host, int(port), int(world_size), tuple(range(int(rank_offset), int(world_size))), 0, backend,
                   prefixes)

    @classmethod
    def trainer_last(cls, host: str, port: int, world_size: int, backend: str) -> "Layout":
        """TRL's: the receiving side is ranks 0 .. world_size - 2 and serves the store, the trainer the last rank,
        keys under :data:`TRL_PREFIX`."""
        return cls(host, int(port), int(world_size), tuple(range(int(world_size) - 1)), int(world_size) - 1,
                   backend, (TRL_PREFIX,), hosts_store=True)
