"""Who builds a model's linear layers: :class:`Linears` the plain ones; its FP8 subclass
(:class:`.fp8_layers.Fp8Linears`) FP8 ones where the model's quantization config puts them.

Every builder call names the layer as checkpoints name it (``model.layers.0.mlp``) and, for a fused
layer, the checkpoint projections it holds (``gate_proj``, ``up_proj``): quantization configs
select layers by those names.

The blocks built of these layers take a builder by what they ask of it (:class:`.layers.LayerBuilder`,
:class:`.experts.moe.ExpertsBuilder`), so the dependency runs one way: the builders import the layers and the
experts, and neither imports a builder.
"""

from __future__ import annotations

import torch

from .layers import ColumnParallelLinear, GatheredRowLinear, RowParallelLinear
from .experts.moe import FusedExperts
from .parallel import SINGLE, TensorParallel


class Linears:
    """Builds unquantized layers."""

    def column(self, name: str, parts: tuple[str, ...], in_features: int, shards: dict[str, tuple[int, int]],
               bias: bool = False, tp: TensorParallel = SINGLE) -> ColumnParallelLinear:
        return ColumnParallelLinear(in_features, shards, bias, tp)

    def row(self, name: str, in_features: int, out_features: int, tp: TensorParallel = SINGLE,
            reduce: bool = True) -> RowParallelLinear | GatheredRowLinear:
        """A row-parallel layer; under ``tp.gathered_rows`` one that computes one rank's bits
        (:class:`.layers.GatheredRowLinear`: the FP8 builder's layers and those leaving their reduction to the
        caller stay row-parallel)."""
        if tp.gathered_rows and tp.size > 1 and reduce:
            return GatheredRowLinear(in_features, out_features, tp)
        return RowParallelLinear(in_features, out_features, tp, reduce)

    def experts(self, name: str, parts: tuple[str, ...], num_experts: int, hidden_size: int, intermediate_size: int,
                tp: TensorParallel, device: torch.device) -> FusedExperts:
        """One MoE layer's experts; ``parts`` are every expert's projections under ``name``."""
        return FusedExperts(num_experts, hidden_size, intermediate_size, tp, device)


PLAIN_LINEARS = Linears()
