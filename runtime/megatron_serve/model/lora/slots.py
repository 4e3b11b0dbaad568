"""The adapter slot table: ``max_loras`` slots of LoRA weights on the model's device, rank padded to
``max_lora_rank``, applied to the rows of a step that use an adapter.

Every attention and dense-MLP projection of the decoder gets a forward hook that adds
``(x @ A_slot^T) @ B_slot^T`` (``B`` pre-multiplied by the adapter's scaling) to the rows whose slot
is set, through the dispatcher's ``lora_shrink``/``lora_expand``. A fused projection (q|k|v,
gate|up) stacks its parts' ``A`` along the rank, so one shrink serves all its parts, and keeps each
part's ``B`` apart, one expand per part: the zero blocks of a block-diagonal ``B`` would cost a third
(q|k|v) or half (gate|up) of the expand's work and memory reads. A part the adapter leaves out stays
zero. The base path is untouched: without ``--enable-lora`` no hook exists, and a step with no
adapter row returns from each hook at once.

An MoE layer's experts (:mod:`.lora_experts`) get a hook too: the expert MLP is nonlinear between its
two projections, so no delta can be added to the experts' output; the rows of each slot whose adapter
adapts the experts are computed again, expert by expert, with ``W + B A`` in both projections, and
replace the fused kernel's rows. Rows of the base model and of adapters without expert weights keep
the fused kernel's result. Correct first: the adapted rows cost a second, unfused pass over their experts.
Under tensor parallelism each rank recomputes its rows with its slice of the experts and its share of the
adapter (:func:`.lora_shards.expert_share`): the replaced rows are partial sums like the fused kernel's, which
the MoE block reduces once (the all-reduce, or the fixed-order sum of ``--batch-invariant``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from megatron_kernels import get_op, invariant_lora
from megatron_kernels.reference_lora import LoraBatch, slot_table

from ..config import ModelConfig
from .checkpoint import LoraAdapter, LoraAdapterError, projection_shape
from .experts import EXPERT_PROJECTIONS, expert_shape
from .shards import expert_share, lora_shard
from ..experts.moe import FusedExperts

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
                 rows: LoraRows, device: torch.device, dtype: torch.dtype, module: nn.Module, batch_invariant: bool):
        shapes = [projection_shape(config, layer, part) for part in parts]
        shard = lora_shard(module, parts, shapes)
        self.parts = parts
        self.rank = rank
        self.out_rows, self.in_columns, self.tp, self.whole = shard.out_rows, shard.in_columns, shard.tp, shard.whole
        self.a = slot_table(slots, len(parts) * rank, self.in_columns[1], device, dtype)
        # B is block-diagonal over the parts: each part keeps its own block, so an expand reads no zero block and
        # each slot's block is one contiguous stretch of memory
        self.blocks: dict[str, tuple[slice, slice, torch.Tensor]] = {}  # part -> (output columns, ranks, block)
        for index, part in enumerate(parts):
            offset, _, length = self.out_rows[part]
            if length:
                height = shapes[index][0] if self.whole else length
                self.blocks[part] = (slice(offset, offset + length), slice(index * rank, (index + 1) * rank),
                                     slot_table(slots, height, rank, device, dtype))
        self.rows = rows
        self.shrink = invariant_lora.lora_shrink if batch_invariant else get_op("lora_shrink", device)
        self.expand = invariant_lora.lora_expand if batch_invariant else get_op("lora_expand", device)

    def write(self, slot: int, layer: int, adapter: LoraAdapter) -> None:
        """This rank's share of the adapter: its rows of ``B`` (column-parallel), its columns of ``A`` (row-parallel)."""
        self.a[slot].zero_()
        for _, _, table in self.blocks.values():
            table[slot].zero_()
        in_start, in_length = self.in_columns
        for index, part in enumerate(self.parts):
            pair = adapter.weights.get((layer, part))
            if pair is None:
                continue
            a, b = pair
            ranks = slice(index * self.rank, index * self.rank + a.shape[0])
            self.a[slot, ranks].copy_(a[:, in_start : in_start + in_length])
            if part in self.blocks:
                _, start, length = self.out_rows[part]
                self.blocks[part][2][slot, :, : a.shape[0]].copy_(b if self.whole else b[start : start + length])

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        batch = self.rows.batch
        if batch is None and self.tp is None:
            return output
        x = args[0]
        if batch is not None:
            y = output.view(-1, output.shape[-1])
            h = self.shrink(x.reshape(-1, x.shape[-1]), self.a, batch)
            for part, (columns, ranks, b) in self.blocks.items():  # part by part: B's zero blocks cost nothing
                if self.whole:
                    self._add_cut(y[:, columns], h[:, ranks], b, batch, self.out_rows[part][1])
                else:
                    self.expand(y[:, columns], h[:, ranks], b, batch)
        if self.tp is None:
            return output
        # a row-parallel projection under TP: its partial sums (delta included) reduced as the base layer does
        return self.tp.ordered_sum(output) if module.batch_invariant else self.tp.all_reduce(output)

    def _add_cut(self, y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, batch: LoraBatch, start: int) -> None:
        """``y +=`` its columns (from ``start``) of a part's whole delta, computed as one rank computes it
        (:attr:`.shards.LoraShard.whole`). The delta is expanded into ``-0.0``, IEEE's additive identity
        (``-0.0 + 0.0`` is ``0.0``), so it holds the bits one rank adds, signed zeros included."""
        delta = torch.full((y.shape[0], b.shape[1]), -0.0, dtype=y.dtype, device=y.device)
        self.expand(delta, h, b, batch)
        y += delta[:, start : start + y.shape[1]]


class _ExpertSlotWeights:
    """One MoE layer's expert LoRA weights per slot, ``[slots, E, rank, in]`` and ``[slots, E, out, rank]`` for each
    expert projection (this rank's share under TP: :func:`.lora_shards.expert_share`), and the hook that recomputes
    the adapted rows.

    Under expert parallelism row ``i`` of a slot's table belongs to the expert in the rank's stack slot ``i``
    (``experts.slots``: a logical expert, once per replica under EPLB). EPLB moves experts between the ranks and
    within a stack (:mod:`..experts.moves`), so each slot keeps its adapter's expert tensors (the host copy) and the
    placement its rows were cut for; the hook cuts them again from that copy before it applies a slot whose experts
    moved since. Every replica of an expert thus holds the same rows, and a row's result does not depend on which
    replica ran it."""

    def __init__(self, experts: FusedExperts, slots: int, rank: int, rows: LoraRows, device: torch.device,
                 dtype: torch.dtype, batch_invariant: bool):
        self.batch_invariant = batch_invariant
        self.experts = experts
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for projection in EXPERT_PROJECTIONS:  # the shapes of this rank's slice of the experts
            count, out_features, in_features = getattr(experts, projection.rpartition(".")[2]).shape
            self.a[projection] = torch.zeros(slots, count, rank, in_features, device=device, dtype=dtype)
            self.b[projection] = torch.zeros(slots, count, out_features, rank, device=device, dtype=dtype)
        # each slot's adapter's (A, B) of this layer's expert projections (empty: it adapts none of them; its rows
        # stay zero), and the experts' placement (``experts.slots``) the rows were cut for
        self.sources: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(slots)]
        self.placed: list[list[int]] = [list(experts.slots) for _ in range(slots)]
        self.rows = rows

    def write(self, slot: int, layer: int, adapter: LoraAdapter) -> None:
        self.sources[slot] = {projection: pair for projection in EXPERT_PROJECTIONS
                              if (pair := adapter.weights.get((layer, projection))) is not None}
        self._cut(slot)

    def _cut(self, slot: int) -> None:
        """Fill ``slot``'s rows with this rank's share of its adapter for the experts where they sit now."""
        for projection in EXPERT_PROJECTIONS:
            self.a[projection][slot].zero_()
            self.b[projection][slot].zero_()
            pair = self.sources[slot].get(projection)
            if pair is not None:
                a, b = expert_share(projection, *pair, self.experts)
                self.a[projection][slot, :, : a.shape[1]].copy_(a)
                self.b[projection][slot, :, :, : a.shape[1]].copy_(b)
        self.placed[slot] = list(self.experts.slots)

    def __call__(self, module: FusedExperts, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        batch = self.rows.batch
        if batch is None:
            return output
        hidden, weights, ids, *tokens = args  # tokens: the token of each row, under expert parallelism
        for slot, start, end in batch.segments:
            if self.sources[slot]:
                if self.placed[slot] != module.slots:  # EPLB moved the experts since the slot was cut
                    self._cut(slot)
                rows = batch.order[start:end]
                if tokens:  # the dispatched rows that came from this slot's tokens
                    rows = torch.isin(tokens[0], rows).nonzero().squeeze(1)
                output.index_copy_(0, rows, self._experts(module, hidden[rows], weights[rows], ids[rows], slot))
        return output

    def _experts(self, module: FusedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 slot: int) -> torch.Tensor:
        """The routed experts' weighted sum for rows ``x`` of one slot, with ``W + B A`` in both projections."""
        gate_up, down = EXPERT_PROJECTIONS
        a_gu, b_gu, a_d, b_d = self.a[gate_up][slot], self.b[gate_up][slot], self.a[down][slot], self.b[down][slot]
        flat = ids.reshape(-1)
        tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])
        scale = weights.reshape(-1).to(x.dtype)
        out = torch.zeros_like(x)
        for expert in torch.unique(flat).tolist():
            picked = (flat == expert).nonzero().squeeze(1)
            token = tokens[picked]
            xe = x[token]
            if self.batch_invariant:
                y = invariant_lora.expert_mlp(xe, module.gate_up_proj[expert], a_gu[expert], b_gu[expert],
                                              module.down_proj[expert], a_d[expert], b_d[expert])
            else:
                h = xe @ module.gate_up_proj[expert].T + (xe @ a_gu[expert].T) @ b_gu[expert].T
                gate, up = h.chunk(2, dim=-1)
                act = F.silu(gate) * up
                y = act @ module.down_proj[expert].T + (act @ a_d[expert].T) @ b_d[expert].T
            out.index_add_(0, token, y * scale[picked, None])
        return out


class LoraSlots:
    """``max_loras`` adapter slots attached to a decoder; :meth:`write` fills one (a slot is only ever
    overwritten: an unloaded adapter's weights stay until another adapter takes its slot)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, batch_invariant: bool = False):
        """``batch_invariant``: apply the adapters with :mod:`megatron_kernels.invariant_lora` (``--batch-invariant``),
        so an adapter row's result does not depend on the other rows of its step."""
        config: ModelConfig = model.config
        self.max_loras, self.max_rank = max_loras, max_rank
        self.rows = LoraRows()
        weight = model.model.embed_tokens.weight
        self._targets: list[tuple[int, _SlotWeights | _ExpertSlotWeights]] = []
        self._expert_problem: str | None = None  # why expert weights cannot be served here, if they cannot
        for layer_index, layer in enumerate(model.model.layers):
            if expert_shape(config, layer_index, EXPERT_PROJECTIONS[0]) is not None:
                experts = layer.mlp.experts
                if type(experts) is not FusedExperts or experts.gate_up_proj.dtype != weight.dtype:
                    self._expert_problem = f"its experts are {type(experts).__name__} ({experts.gate_up_proj.dtype})"
                else:
                    target = _ExpertSlotWeights(experts, max_loras, max_rank, self.rows, weight.device, weight.dtype,
                                                batch_invariant)
                    experts.register_forward_hook(target)
                    self._targets.append((layer_index, target))
            for path, parts in FUSED_TARGETS.items():
                if projection_shape(config, layer_index, parts[0]) is None:
                    continue  # an expert layer's MLP
                module = layer.get_submodule(path)
                target = _SlotWeights(config, layer_index, parts, max_loras, max_rank, self.rows, weight.device,
                                      weight.dtype, module, batch_invariant)
                module.register_forward_hook(target)
                self._targets.append((layer_index, target))

    @property
    def graphable(self) -> bool:
        """Whether a CUDA graph can hold the adapter hooks: the expert hook picks its rows on the host."""
        return not any(isinstance(target, _ExpertSlotWeights) for _, target in self._targets)

    def check(self, adapter: LoraAdapter) -> None:
        """:class:`LoraAdapterError` when ``adapter`` holds weights these slots cannot apply (quantized experts)."""
        if self._expert_problem and any(p in EXPERT_PROJECTIONS for _, p in adapter.weights):
            raise LoraAdapterError(f"LoRA adapter {adapter.name!r} adapts MoE experts, which this model cannot serve "
                                   f"with LoRA: {self._expert_problem}")

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Load ``adapter`` into ``slot`` (its rank is at most ``max_rank``: :func:`.lora.read_adapter` checks)."""
        for layer, target in self._targets:
            target.write(slot, layer, adapter)
