"""A checkpoint cut as Megatron's ranks hold it, for the sharded-refit tests: each rank's pieces of every tensor
(:func:`cut`), read from the ``model.safetensors`` file piece by piece (:class:`Checkpoint`), so that a rank never
holds a tensor it does not send. ``sharded_trainer.py`` sends them; ``test_shards.py`` checks the cut itself.
"""

from __future__ import annotations

import json
import os
import re

import torch

from megatron_serve import Shard

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")  # cut by rows
ROW = ("o_proj", "down_proj")  # cut by columns
EXPERT = re.compile(r"\.experts\.(\d+)\.")


#: safetensors dtype names -> torch dtypes: the floating-point tensors a checkpoint cut here holds.
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class Stored:
    """One tensor of a safetensors file, read in rectangles with plain reads into this process's own memory (as a
    trainer holds its shards): a mapped file (``safe_open``) would also count the pages it touched in the
    process's peak, beside any copy of them."""

    def __init__(self, fd: int, base: int, entry: dict) -> None:
        self.fd, self.dtype, self.shape = fd, DTYPES[entry["dtype"]], tuple(entry["shape"])
        self.start = base + entry["data_offsets"][0]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        """The rectangle of plain slices ``index`` on the first two dims (the others whole): one read for whole rows,
        else one per row."""
        index = index if isinstance(index, tuple) else (index,)
        rows, cols = ((index[d] if d < len(index) else slice(None)).indices(self.shape[d])[:2]
                      if d < len(self.shape) else (0, 1) for d in (0, 1))
        out = torch.empty((rows[1] - rows[0], *self.shape[1:]), dtype=self.dtype)
        if len(self.shape) > 1:
            out = torch.empty((rows[1] - rows[0], cols[1] - cols[0], *self.shape[2:]), dtype=self.dtype)
        column = torch.Size(self.shape[2:]).numel() * self.dtype.itemsize
        row = column * (self.shape[1] if len(self.shape) > 1 else 1)
        data = out.view(-1).view(torch.uint8).numpy()
        if cols[1] - cols[0] == (self.shape[1] if len(self.shape) > 1 else 1):
            os.preadv(self.fd, [data], self.start + rows[0] * row)
            return out
        width = (cols[1] - cols[0]) * column
        for r in range(rows[1] - rows[0]):
            os.preadv(self.fd, [data[r * width:(r + 1) * width]], self.start + (rows[0] + r) * row + cols[0] * column)
        return out


class Checkpoint:
    """The tensors of one ``model.safetensors``, each a :class:`Stored` (read only where asked)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        length = int.from_bytes(os.pread(self.fd, 8, 0), "little")
        self.header = {k: v for k, v in json.loads(os.pread(self.fd, length, 8)).items() if k != "__metadata__"}
        self.base = 8 + length

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def keys(self) -> list[str]:
        return list(self.header)

    def get_slice(self, name: str) -> Stored:
        return Stored(self.fd, self.base, self.header[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[:]


def cut(name: str, source, rank: int, world_size: int) -> list[tuple]:
    """This rank's pieces of one tensor (a tensor, or a safetensors slice: only the piece is read): experts whole by
    ``expert % world_size`` (expert parallel), column-parallel and vocabulary weights by rows, row-parallel ones by
    columns, the rest (norms, routers) whole on rank 0."""
    shape = tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)
    expert = EXPERT.search(name)
    if expert is not None:
        return [(name, source[:])] if int(expert.group(1)) % world_size == rank else []
    leaf = name.split(".")[-2]
    dim = 0 if leaf in COLUMN else 1 if leaf in ROW else None
    if dim is None:
        return [(name, source[:])] if rank == 0 else []
    start, stop = shape[dim] * rank // world_size, shape[dim] * (rank + 1) // world_size
    offset = [0] * len(shape)
    offset[dim] = start
    local = source[(slice(None),) * dim + (slice(start, stop),)]
    return [(name, local.clone() if isinstance(source, torch.Tensor) else local, Shard(shape, tuple(offset)))]
