"""The adapter slot table: ``max_loras`` slots of LoRA weights on the model's device, rank padded to
``max_lora_rank``, applied to the rows of a step that use an adapter.

Every attention and dense-MLP projection of the decoder gets a forward hook that adds
``(x @ A_slot^T) @ B_slot^T`` (``B`` pre-multiplied by the adapter's scaling) to the rows whose slot
is set, through the dispatcher's ``lora_shrink``/``lora_expand``. A fused projection (q|k|v,
gate|up) stacks its parts' ``A`` along the rank and lays their ``B`` out block-diagonally, so one
shrink/expand pair serves all its parts; a part the adapter leaves out stays zero. The base path is
untouched: without ``--enable-lora`` no hook exists, and a step with no adapter row returns from
each hook at once.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from megatron_kernels import get_op
from megatron_kernels.reference_lora import LoraBatch

from .config import ModelConfig
from .lora import LoraAdapter, projection_shape

# decoder-layer module -> the checkpoint projections it holds, in the order of its output features
FUSED_TARGETS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


class LoraRows:
    """The coming forward's adapter rows (:class:`~megatron_kernels.reference_lora.LoraBatch`), or None when no
    row uses an adapter."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None

    def set(self, indices: torch.Tensor | None, host: np.ndarray) -> None:
        """``indices``: each row's slot (int64 ``[tokens]``, ``-1``: the base model) on the device and on the host
        (``host``, the same values); None when no row uses an adapter."""
        self.batch = None if indices is None else LoraBatch.of(indices, host)


class _SlotWeights:
    """One projection's slot weights and the hook that applies them."""

    def __init__(self, config: ModelConfig, layer: int, parts: tuple[str, ...], slots: int, rank: int,
                 rows: LoraRows, device: torch.device, dtype: torch.dtype):
        shapes = [projection_shape(config, layer, part) for part in parts]
        in_features = shapes[0][1]
        self.parts = parts
        self.rank = rank
        self.out_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for part, (out_features, _) in zip(parts, shapes):
            self.out_offsets[part] = (offset, out_features)
            offset += out_features
        self.a = torch.zeros(slots, len(parts) * rank, in_features, device=device, dtype=dtype)
        self.b = torch.zeros(slots, offset, len(parts) * rank, device=device, dtype=dtype)
        self.rows = rows
        self.shrink = get_op("lora_shrink", device)
        self.expand = get_op("lora_expand", device)

    def write(self, slot: int, layer: int, adapter: LoraAdapter) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        for index, part in enumerate(self.parts):
            pair = adapter.weights.get((layer, part))
            if pair is None:
                continue
            a, b = pair
            ranks = slice(index * self.rank, index * self.rank + a.shape[0])
            start, length = self.out_offsets[part]
            self.a[slot, ranks].copy_(a)
            self.b[slot, start : start + length, ranks].copy_(b)

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        batch = self.rows.batch
        if batch is None:
            return output
        x = args[0]
        self.expand(output.view(-1, output.shape[-1]), self.shrink(x.reshape(-1, x.shape[-1]), self.a, batch),
                    self.b, batch)
        return output


class LoraSlots:
    """``max_loras`` adapter slots attached to a decoder; :meth:`write` fills one (a slot is only ever
    overwritten: an unloaded adapter's weights stay until another adapter takes its slot)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int):
        config: ModelConfig = model.config
        if model.tp.size != 1:
            raise ValueError("LoRA adapters are served with tensor_parallel_size=1 only, for now")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.rows = LoraRows()
        weight = model.model.embed_tokens.weight
        self._targets: list[tuple[int, _SlotWeights]] = []
        for layer_index, layer in enumerate(model.model.layers):
            for path, parts in FUSED_TARGETS.items():
                if projection_shape(config, layer_index, parts[0]) is None:
                    continue  # an expert layer's MLP
                module = layer.get_submodule(path)
                target = _SlotWeights(config, layer_index, parts, max_loras, max_rank, self.rows, weight.device,
                                      weight.dtype)
                module.register_forward_hook(target)
                self._targets.append((layer_index, target))

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Load ``adapter`` into ``slot`` (its rank is at most ``max_rank``: :func:`.lora.read_adapter` checks)."""
        for layer, target in self._targets:
            target.write(slot, layer, adapter)
