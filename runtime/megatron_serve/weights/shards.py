"""Pieces of tensors as a sharded trainer holds them, and which bytes go from which trainer rank to which engine rank.

A trainer rank holds rectangular pieces of the checkpoint's (Hugging Face) tensors: a column-parallel weight cut
by rows, a row-parallel one by columns, an expert whole. An engine rank serves rectangular regions of them (its
tensor-parallel slice; an expert-parallel rank its experts; a pipeline stage its layers): what its loader reads,
:mod:`.layout`. The transfer plan is the intersection of the two: for every (trainer rank, engine rank) pair, the
rectangles both hold, in a fixed order, cut into buckets of at most ``bucket_bytes``. Both sides compute it from
the same inputs (the pieces travel in the REFIT, each engine rank publishes its regions), so the wire carries
only raw bucket bytes, and nobody ever holds a tensor it does not serve.

:func:`cover_problem` is the trainer's pieces checked before any engine changes: every name covered exactly once
(no overlap, no gap), every piece inside the full shape the manifest says.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

import torch

from ..wire.rendezvous import TRANSFER_DTYPES, PieceSpec, TensorSpec
from .manifest import ALIGNMENT, spec_of

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start on every dim, size on every dim)
IN_FLIGHT = 2  # buckets posted per link at a time: one on the wire while the previous one is copied


# Keys of the transfer's store: what an engine rank serves (with its digests), what a trainer rank changed
# (under a delta), and what an engine rank received (its figures for the acknowledgement).
def layout_key(rank: int) -> str:
    return f"layout/{rank}"


def changed_key(sender: int) -> str:
    return f"changed/{sender}"


def received_key(rank: int) -> str:
    return f"received/{rank}"


@dataclass(frozen=True)
class Shard:
    """Where a trainer's local tensor lies in the full one: it covers ``full[offset[i] : offset[i] + local.shape[i]]``
    on every dim ``i``. ``WeightSender.send`` takes ``(name, local_tensor, Shard(full_shape, offset))``."""

    full_shape: tuple[int, ...]
    offset: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_shape", tuple(int(s) for s in self.full_shape))
        object.__setattr__(self, "offset", tuple(int(o) for o in self.offset))
        if len(self.full_shape) != len(self.offset):
            raise ValueError(f"Shard offset {self.offset} has {len(self.offset)} dims but full_shape "
                             f"{self.full_shape} has {len(self.full_shape)}")
        if any(s < 0 for s in self.full_shape) or any(o < 0 for o in self.offset):
            raise ValueError(f"Shard sizes and offsets must be >= 0, got {self.full_shape} at {self.offset}")


#: What a trainer rank sends: ``(name, tensor)``, or ``(name, local tensor, Shard)`` for a piece of one.
Item = Union[tuple[str, torch.Tensor], tuple[str, torch.Tensor, Shard]]


def piece_of(item: Item, rank: int, prefix: str = "") -> tuple[TensorSpec, PieceSpec, torch.Tensor]:
    """The manifest entry (full shape), the piece and the local tensor of one item; ``ValueError`` naming it."""
    if not (isinstance(item, tuple) and len(item) in (2, 3)):
        raise ValueError(f"weights must be (name, tensor) or (name, tensor, Shard) tuples, got {type(item).__name__}")
    name, tensor, shard = (*item, None) if len(item) == 2 else item
    if shard is not None and not isinstance(shard, Shard):
        raise ValueError(f"weight {name!r}: the third element must be a megatron_serve.Shard, got "
                         f"{type(shard).__name__}")
    spec = spec_of(prefix + name if isinstance(name, str) else name, tensor,
                   None if shard is None else shard.full_shape)
    if shard is not None and tensor.dim() != len(shard.full_shape):
        raise ValueError(f"weight {name!r}: a piece of {tensor.dim()} dims of a tensor of {len(shard.full_shape)}")
    offset = (0,) * tensor.dim() if shard is None else shard.offset
    return spec, PieceSpec(spec.name, rank, offset, tuple(tensor.shape)), tensor.detach()


def merge_manifests(gathered: Sequence[Sequence[tuple[TensorSpec, PieceSpec]]]
                    ) -> tuple[list[TensorSpec], list[PieceSpec]]:
    """Every trainer rank's ``(spec, piece)`` pairs, in rank order, as one manifest (first appearance order) and
    its pieces; ``ValueError`` when ranks disagree on a tensor's full shape or dtype."""
    manifest: dict[str, TensorSpec] = {}
    pieces: list[PieceSpec] = []
    for pairs in gathered:
        for spec, piece in pairs:
            known = manifest.setdefault(spec.name, spec)
            if (known.shape, known.dtype) != (spec.shape, spec.dtype):
                raise ValueError(f"trainer ranks disagree on {spec.name!r}: full shape {tuple(known.shape)} "
                                 f"{known.dtype} (trainer rank {pieces_rank(pieces, spec.name)}) against "
                                 f"{tuple(spec.shape)} {spec.dtype} (trainer rank {piece.rank})")
            pieces.append(piece)
    return list(manifest.values()), pieces


def pieces_rank(pieces: Sequence[PieceSpec], name: str) -> int:
    return next(p.rank for p in pieces if p.name == name)


def volume(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def intersect(a: Box, b: Box) -> Box | None:
    """The box two boxes share, or None when they share no element."""
    start, size = [], []
    for a0, an, b0, bn in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
        if hi <= lo:
            return None
        start.append(lo)
        size.append(hi - lo)
    return tuple(start), tuple(size)


def describe(box: Box) -> str:
    return "[" + ", ".join(f"{s}:{s + n}" for s, n in zip(*box)) + "]"


def cover_problem(manifest: Sequence[TensorSpec], pieces: Sequence[PieceSpec]) -> str | None:
    """Why these pieces do not cover every manifest tensor exactly once (overlap, gap, outside), or None."""
    shapes = {spec.name: tuple(spec.shape) for spec in manifest}
    by_name: dict[str, list[PieceSpec]] = {name: [] for name in shapes}
    for piece in pieces:
        full = shapes.get(piece.name)
        if full is None:
            return f"piece of {piece.name!r} from trainer rank {piece.rank}: the manifest has no such tensor"
        if len(piece.offset) != len(full) or len(piece.shape) != len(full):
            return (f"piece of {piece.name!r} from trainer rank {piece.rank} has {len(piece.shape)} dims, "
                    f"the full shape {full} has {len(full)}")
        if any(o < 0 or o + n > f for o, n, f in zip(piece.offset, piece.shape, full)):
            return (f"piece of {piece.name!r} from trainer rank {piece.rank} at {describe((piece.offset, piece.shape))} "
                    f"lies outside its full shape {full}")
        by_name[piece.name].append(piece)
    for name, full in shapes.items():
        found = by_name[name]
        for i, a in enumerate(found):
            for b in found[i + 1:]:
                shared = intersect((a.offset, a.shape), (b.offset, b.shape))
                if shared is not None:
                    return (f"pieces of {name!r} from trainer ranks {a.rank} and {b.rank} overlap at "
                            f"{describe(shared)}")
        covered = sum(volume(p.shape) for p in found)
        if covered != volume(full):
            return (f"pieces of {name!r} leave a gap: they cover {covered} of its {volume(full)} elements "
                    f"(full shape {full})")
    return None


@dataclass(frozen=True)
class Chunk:
    """One rectangle that one trainer rank sends one engine rank: of manifest tensor ``tensor``, inside the sender's
    piece ``piece`` (an index into the REFIT's pieces), at ``box`` in full-tensor coordinates."""

    tensor: int
    piece: int
    box: Box
    nbytes: int

    @property
    def key(self) -> str:
        """The chunk's identity across refits (a delta compares digests by it)."""
        return describe(self.box)


@dataclass(frozen=True)
class LinkBucket:
    """Chunks sent back to back in one flat buffer, each at an aligned byte offset."""

    chunks: tuple[Chunk, ...]
    offsets: tuple[int, ...]
    nbytes: int


def _split(box: Box, itemsize: int, bucket_bytes: int) -> Iterable[Box]:
    """Cut a box along its first dim into parts of at most ``bucket_bytes`` (a single row larger travels alone)."""
    start, size = box
    if not size or volume(size) * itemsize <= bucket_bytes:
        yield box
        return
    row = volume(size[1:]) * itemsize
    rows = max(1, bucket_bytes // max(row, 1))
    for first in range(0, size[0], rows):
        count = min(rows, size[0] - first)
        yield (start[0] + first, *start[1:]), (count, *size[1:])


def link_chunks(manifest: Sequence[TensorSpec], pieces: Sequence[PieceSpec], sender: int,
                regions: dict[str, Box], bucket_bytes: int) -> list[Chunk]:
    """What trainer rank ``sender`` sends to an engine rank serving ``regions``, in order (pieces, then parts)."""
    index = {spec.name: i for i, spec in enumerate(manifest)}
    chunks = []
    for number, piece in enumerate(pieces):
        region = regions.get(piece.name)
        if piece.rank != sender or region is None:
            continue
        shared = intersect((tuple(piece.offset), tuple(piece.shape)), region)
        if shared is None:
            continue
        itemsize = TRANSFER_DTYPES[manifest[index[piece.name]].dtype]
        for part in _split(shared, itemsize, bucket_bytes):
            chunks.append(Chunk(index[piece.name], number, part, volume(part[1]) * itemsize))
    return chunks


def buckets_of(chunks: Sequence[Chunk], bucket_bytes: int) -> list[LinkBucket]:
    """Consecutive chunks packed into buckets of at most ``bucket_bytes`` (a larger chunk alone)."""
    out: list[LinkBucket] = []
    current: list[Chunk] = []
    offsets: list[int] = []
    end = 0
    for chunk in chunks:
        start = -(-end // ALIGNMENT) * ALIGNMENT
        if current and start + chunk.nbytes > bucket_bytes:
            out.append(LinkBucket(tuple(current), tuple(offsets), end))
            current, offsets, start = [], [], 0
        current.append(chunk)
        offsets.append(start)
        end = start + chunk.nbytes
    if current:
        out.append(LinkBucket(tuple(current), tuple(offsets), end))
    return out


def local_view(tensor: torch.Tensor, offset: Sequence[int], box: Box) -> torch.Tensor:
    """The part of ``tensor`` (which lies at ``offset`` in the full tensor) at full-tensor ``box``."""
    view = tensor
    for dim, (start, size) in enumerate(zip(*box)):
        view = view.narrow(dim, start - offset[dim], size)
    return view


def digest(flat: torch.Tensor) -> str:
    """A digest of a chunk's bytes as they travel (``uint8``, contiguous), computed in host memory."""
    data = flat.detach().cpu().contiguous().numpy()
    return hashlib.blake2b(data.data, digest_size=16).hexdigest()
