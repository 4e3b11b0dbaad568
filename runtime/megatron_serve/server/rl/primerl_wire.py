"""prime-rl's NCCL weight broadcast as its receiver reads it, over a joined :class:`~.weight_bridge.TrainerGroup`.

The sender (prime-rl's ``src/prime_rl/trainer/rl/broadcast/nccl.py``: ``broadcast_integer``,
``broadcast_state_dict``) frames one update as: an int64, the number of state dicts (the weights outside the
layers, then one per layer); per state dict an int64 size, that many bytes of pickled metadata
``{dtype: [(name, shape, numel), ...]}``, then one concatenated tensor per dtype, in the metadata's order. Its
receiver (``src/prime_rl/inference/vllm/worker/nccl.py``) reads the same. The stream describes itself: nothing is
announced over HTTP first, so the names, dtypes and shapes are checked once the whole stream was read (the trainer
then finishes its broadcast, and the group stays usable for the next one).

Imported only when an update is received: it needs torch, as the bridge does.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from ...weights.framework_groups import announced
from ...weights.manifest import torch_dtype
from .weight_bridge import TrainerGroup

#: The most bytes of metadata a state dict may announce: a layer's names and shapes, far below it.
METADATA_LIMIT = 64 << 20

#: One state dict's metadata, checked: per dtype, in the order sent, its tensors' (name, shape, numel).
Metadata = list[tuple[torch.dtype, list[tuple[str, list[int], int]]]]


class _MetadataUnpickler(pickle.Unpickler):
    """The sender's metadata only. Unpickling a peer's bytes runs whatever callables they name, so no global is
    resolved but ``torch.Size`` and torch's dtypes; dicts, lists, tuples, strings and integers need none. Anything
    else is refused before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of prime-rl's weight metadata")


def receive_state_dicts(group: TrainerGroup) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of one broadcast, in the order sent. ``RuntimeError`` when the stream cannot be followed (its
    framing is not prime-rl's: the rest of it would be misread); ``ValueError`` naming a dtype that cannot travel, a
    name given twice or a shape that is not its numel, once the whole stream was read."""
    count = _integer(group)
    if count < 1:
        raise RuntimeError(f"prime-rl's broadcast announced {count} state dicts")
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    pieces: list[torch.Tensor] = []
    for _ in range(count):
        size = _integer(group)
        if not 0 < size <= METADATA_LIMIT:
            raise RuntimeError(f"prime-rl's state dict metadata of {size} bytes (at most {METADATA_LIMIT})")
        for dtype, entries in metadata_of(group.receive_tensor(size, torch.uint8).numpy().tobytes()):
            flat = group.receive_tensor(sum(numel for _, _, numel in entries), dtype).view(torch.uint8)
            offset = 0
            for name, shape, numel in entries:
                names.append(name)
                dtypes.append(str(dtype))
                shapes.append(shape)
                pieces.append(flat[offset:offset + numel * dtype.itemsize])
                offset += numel * dtype.itemsize
    metas = announced(names, dtypes, shapes)
    for meta, piece in zip(metas, pieces):
        if piece.numel() != meta.nbytes:
            raise ValueError(f"tensor {meta.name!r}: shape {meta.shape} does not hold the elements sent for it")
    return [(meta.name, piece.clone().view(torch_dtype(meta.dtype)).view(meta.shape))
            for meta, piece in zip(metas, pieces)]


def _integer(group: TrainerGroup) -> int:
    """``broadcast_integer``'s value: one int64."""
    return int(group.receive_tensor(1, torch.int64).item())


def metadata_of(raw: bytes) -> Metadata:
    """One state dict's metadata, its shape checked; ``RuntimeError`` for anything but prime-rl's dict."""
    try:
        value = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 - a malformed pickle raises whatever its opcodes hit
        raise RuntimeError(f"prime-rl's state dict metadata does not unpickle: {exc}") from None
    if not isinstance(value, dict):
        raise RuntimeError(f"prime-rl's state dict metadata is a {type(value).__name__}, not a dict")
    checked: Metadata = []
    for dtype, entries in value.items():
        if not isinstance(dtype, torch.dtype) or not isinstance(entries, (list, tuple)):
            raise RuntimeError(f"prime-rl's state dict metadata maps {dtype!r} to {type(entries).__name__}")
        checked.append((dtype, [_entry(entry) for entry in entries]))
    return checked


def _entry(entry: Any) -> tuple[str, list[int], int]:
    """One ``(name, shape, numel)``: the numel says how many elements the concatenated tensor holds for it."""
    if (not isinstance(entry, (list, tuple)) or len(entry) != 3 or not isinstance(entry[1], (list, tuple))
            or not all(isinstance(n, int) for n in (*entry[1], entry[2])) or entry[2] < 0):
        raise RuntimeError(f"prime-rl's state dict metadata entry {entry!r} is not (name, shape, numel)")
    return entry[0], list(entry[1]), entry[2]
