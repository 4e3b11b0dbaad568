"""Which region of each checkpoint tensor an engine rank serves, found by running its own loader on a shadow.

The loaders of the layers already know each rank's slice (a column-parallel layer's rows, fused QKV and gate-up
parts, a row-parallel layer's columns, a vocabulary's rows, replicated norms, an expert-parallel rank's experts,
FP8 blocks): :func:`engine_layout` hands each tensor of a refit to the real loading path of a shape-only (meta)
copy of the model, with a source that records what it reads, so the layout is exactly what loading will read and
needs no table of its own. A pipeline stage or an expert-parallel rank whose model lacks a tensor reads nothing of
it and gets nothing; only what no rank's model reads (a drafter's, an adapter's, MTP layers) goes whole to the
group's rank 0. This is the seam: a new layout is a new model layout, nothing here changes.

:class:`RegionSlice` is the other half: what a rank received, handed to the same loader as if it were a
safetensors slice of the full tensor (it answers only reads inside its region).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ..model.llama import LlamaForCausalLM
from ..model.loader import build_model, load_weights
from ..wire.rendezvous import TensorSpec
from .adapters import is_adapter
from .drafter import is_drafter
from .manifest import torch_dtype
from .shards import Box

_SAFETENSORS_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def _bounds(index: object, shape: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` per dim of a basic-slicing index (what the loaders use: slices, no steps)."""
    items = index if isinstance(index, tuple) else (index,)
    out = []
    for dim, size in enumerate(shape):
        item = items[dim] if dim < len(items) else slice(None)
        if not isinstance(item, slice) or item.step not in (None, 1):
            raise TypeError(f"a received tensor is read by plain slices only, got {item!r}")
        start, stop, _ = item.indices(size)
        out.append((start, max(start, stop)))
    return out


class RegionSlice:
    """A safetensors-slice look-alike of a full tensor of which only ``data``, at ``start``, is here."""

    def __init__(self, full_shape: Sequence[int], start: Sequence[int], data: torch.Tensor) -> None:
        self.full_shape, self.start, self.data = tuple(full_shape), tuple(start), data

    def get_shape(self) -> list[int]:
        return list(self.full_shape)

    def get_dtype(self) -> str:
        return _SAFETENSORS_NAMES[self.data.dtype]

    def __getitem__(self, index: object) -> torch.Tensor:
        view = self.data
        for dim, (lo, hi) in enumerate(_bounds(index, self.full_shape)):
            first = lo - self.start[dim]
            if first < 0 or hi - self.start[dim] > self.data.shape[dim]:
                raise ValueError(f"reads [{lo}:{hi}] of dim {dim}, outside the region this rank received "
                                 f"([{self.start[dim]}:{self.start[dim] + self.data.shape[dim]}])")
            view = view.narrow(dim, first, hi - lo)
        return view


class _Recorder:
    """A source that answers every read with a meta tensor and remembers the box around what was read."""

    def __init__(self, spec: TensorSpec) -> None:
        self.spec = spec
        self.shape, self.dtype = tuple(spec.shape), torch_dtype(spec.dtype)
        self.low: list[int] | None = None
        self.high: list[int] = []

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return _SAFETENSORS_NAMES[self.dtype]

    def __getitem__(self, index: object) -> torch.Tensor:
        bounds = _bounds(index, self.shape)
        if self.low is None:
            self.low, self.high = [lo for lo, _ in bounds], [hi for _, hi in bounds]
        else:
            self.low = [min(a, lo) for a, (lo, _) in zip(self.low, bounds)]
            self.high = [max(a, hi) for a, (_, hi) in zip(self.high, bounds)]
        return torch.empty([hi - lo for lo, hi in bounds], dtype=self.dtype, device="meta")

    def box(self) -> Box | None:
        if self.low is None or any(hi <= lo for lo, hi in zip(self.low, self.high)):
            return None
        return tuple(self.low), tuple(hi - lo for lo, hi in zip(self.low, self.high))


def _record(shadow: LlamaForCausalLM, recorders: list[tuple[str, _Recorder]]) -> None:
    """Run the loader of ``shadow`` over ``recorders`` (each remembers what was read of it)."""
    try:
        load_weights(shadow, recorders, partial=True)  # one pass (a pass per tensor costs the model's size each)
    except ValueError:  # a tensor with no place (an MTP layer's, which its drafter checks): one at a time
        for name, recorder in recorders:
            recorder.low = None
            try:
                load_weights(shadow, [(name, recorder)], partial=True)
            except ValueError:
                recorder.low = None


def engine_layout(model: LlamaForCausalLM, manifest: Iterable[TensorSpec], holds_extra: bool) -> dict[str, Box]:
    """The region of each manifest tensor this rank serves (absent: none of it).

    ``holds_extra``: this rank also keeps what no rank's model has a place for (a drafter's tensors, MTP layers,
    LoRA adapters: a group's rank 0 loads them whole, beside the policy). A tensor this rank's model does not read
    but another rank's does (another expert-parallel rank's experts, another pipeline stage's layers) is not
    extra: a whole, single-rank copy of the model tells them apart.
    """
    shadow = build_model(model.config, torch.float32, "meta", model.tp)
    recorders = {spec.name: _Recorder(spec) for spec in manifest}
    policy = [(name, recorder) for name, recorder in recorders.items() if not is_drafter(name) and not is_adapter(name)]
    _record(shadow, policy)
    layout: dict[str, Box] = {name: box for name, box in ((n, r.box()) for n, r in recorders.items())
                              if box is not None}
    if not holds_extra:
        return layout
    unread = [(name, _Recorder(recorders[name].spec)) for name, recorder in policy if name not in layout]
    if unread:  # read by another rank of the layout, or by none (then extra)
        _record(build_model(model.config, torch.float32, "meta"), unread)
    for name in [*(n for n, r in unread if r.box() is None),
                 *(n for n in recorders if is_drafter(n) or is_adapter(n))]:
        shape = recorders[name].shape
        if all(shape):
            layout[name] = (tuple(0 for _ in shape), tuple(shape))
    return layout
