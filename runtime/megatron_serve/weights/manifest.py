"""What a trainer sends, described before any byte moves: the manifest, and how it is cut into buckets.

Both sides compute the bucket layout from the manifest with :func:`plan_buckets`, so the wire
carries only the manifest (names, full shapes, dtypes) and raw bucket bytes. A bucket is one flat
``uint8`` buffer holding whole tensors back to back, each at an offset aligned to
:data:`ALIGNMENT` bytes so that the receiver can view its slice as the tensor's dtype without a
copy. A tensor larger than the bucket size travels alone in a bucket of its own size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from ..wire.rendezvous import TRANSFER_DTYPES, TensorSpec

ALIGNMENT = 64  # bytes; views of any float dtype (and vectorised copies) need an aligned start

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64}
_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def spec_of(name: str, tensor: torch.Tensor, full_shape: tuple[int, ...] | None = None) -> TensorSpec:
    """The manifest entry of one named tensor (``full_shape``: of the whole, when ``tensor`` is a piece of it);
    ``ValueError`` naming it when it cannot travel."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    dtype = _NAMES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"weight {name!r} has dtype {tensor.dtype}; weights travel as one of "
                         f"{', '.join(TRANSFER_DTYPES)}")
    return TensorSpec(name, tuple(tensor.shape) if full_shape is None else tuple(full_shape), dtype)


def nbytes(spec: TensorSpec) -> int:
    count = 1
    for size in spec.shape:
        count *= size
    return count * TRANSFER_DTYPES[spec.dtype]


@dataclass(frozen=True)
class Bucket:
    """Tensors ``first .. first + len(offsets) - 1`` of the manifest, at these byte offsets."""

    first: int
    offsets: tuple[int, ...]
    nbytes: int


def plan_buckets(manifest: Iterable[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Cut the manifest, in order, into buckets of at most ``bucket_bytes`` (a larger tensor alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[Bucket] = []
    first, offsets, end = 0, [], 0
    for index, spec in enumerate(manifest):
        size = nbytes(spec)
        start = -(-end // ALIGNMENT) * ALIGNMENT
        if offsets and start + size > bucket_bytes:
            buckets.append(Bucket(first, tuple(offsets), end))
            first, offsets, start = index, [], 0
        offsets.append(start)
        end = start + size
    if offsets:
        buckets.append(Bucket(first, tuple(offsets), end))
    return buckets


def pack(bucket: Bucket, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bucket's bytes on ``device``: its tensors copied in at their offsets."""
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    for offset, tensor in zip(bucket.offsets, tensors[bucket.first:bucket.first + len(bucket.offsets)]):
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        buffer[offset:offset + flat.numel()].copy_(flat)
    return buffer


def unpack(bucket: Bucket, manifest: list[TensorSpec], buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of the bucket's tensors in ``buffer`` (no copy), with their names."""
    out = []
    for offset, spec in zip(bucket.offsets, manifest[bucket.first:bucket.first + len(bucket.offsets)]):
        view = buffer[offset:offset + nbytes(spec)].view(torch_dtype(spec.dtype)).view(spec.shape)
        out.append((spec.name, view))
    return out
