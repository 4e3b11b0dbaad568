"""Building blocks of the decoder, shaped for tensor parallelism.

Linear layers own only their rank's slice and know how to cut that slice out of a full
checkpoint tensor (``weight_loader``), so loading never needs the whole weight on one rank.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from megatron_kernels import dense, invariant
from torch import nn

from .parallel import SINGLE, TensorParallel
from .tensor_source import TensorSource, check_full, copy_checked, narrow

if TYPE_CHECKING:  # annotations only: the layers never build a config
    from .config import RopeConfig

class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; each rank's output is its slice (no communication).

    ``shards`` maps each fused part (q|k|v, gate|up) to ``(features, unit)``: a part is split across
    ranks in whole units (a head, a feature), and the fused weight on a rank is the concatenation of
    its slices. A part with fewer units than ranks (KV heads under wide TP) is replicated: groups of
    ranks share one unit.
    """

    def __init__(self, in_features: int, shards: dict[str, tuple[int, int]], bias: bool = False,
                 tp: TensorParallel = SINGLE, weight_dtype: torch.dtype | None = None):
        super().__init__()
        self.tp = tp
        self.slices: dict[str, tuple[int, int, int]] = {}  # name -> (offset here, start in checkpoint, length)
        self.features = {name: features for name, (features, _unit) in shards.items()}  # full, per part
        offset = 0
        for name, (features, unit) in shards.items():
            start, length = self._rank_slice(name, features, unit)
            self.slices[name] = (offset, start, length)
            offset += length
        self.weight = nn.Parameter(torch.empty(offset, in_features, dtype=weight_dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(offset), requires_grad=False) if bias else None
        self.batch_invariant = False
        self.fused_invariant = False  # set by the model where its probe found fused columns equal to the parts

    def _rank_slice(self, name: str, features: int, unit: int) -> tuple[int, int]:
        units = features // unit
        ranks = self.tp.size
        if units >= ranks:
            if units % ranks:
                raise ValueError(f"{name}: {units} units do not split over {ranks} ranks")
            length = features // ranks
            return self.tp.rank * length, length
        if ranks % units:
            raise ValueError(f"{name}: {units} units cannot be replicated evenly over {ranks} ranks")
        return (self.tp.rank * units // ranks) * unit, unit

    def weight_pieces(self, param_name: str) -> frozenset:
        """The fused parts a checkpoint fills separately (q, k, v / gate, up)."""
        return frozenset((name, None) for name in self.slices)

    def weight_loader(self, param: nn.Parameter, source: TensorSource, shard: str | None = None) -> None:
        name = shard if shard is not None else next(iter(self.slices))
        offset, start, length = self.slices[name]
        check_full(source, 0, self.features[name])
        copy_checked(param.narrow(0, offset, length), narrow(source, 0, start, length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return self._invariant_forward(x)
        return dense.linear(x, self.weight, self.bias)

    def _invariant_forward(self, x: torch.Tensor) -> torch.Tensor:
        """With :attr:`fused_invariant` the fused parts (q, k, v / gate, up) in one invariant GEMM: each column
        has the bits of the checkpoint's separate projection (a trainer's) whatever the parts beside it, where
        the model's probe at start found so; else each part its own GEMM, as a checkpoint's separate
        projections compute them (on an AMD EPYC a part of 8 columns fused among 24 rounded otherwise; widths
        of whole column tiles held everywhere probed)."""
        if self.fused_invariant or len(self.slices) == 1:
            return invariant.linear(x, self.weight, self.bias)
        parts = []
        for offset, _start, length in self.slices.values():
            bias = None if self.bias is None else self.bias.narrow(0, offset, length)
            parts.append(invariant.linear(x, self.weight.narrow(0, offset, length), bias))
        return torch.cat(parts, dim=-1)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial outputs are summed with an all-reduce.

    ``reduce=False`` leaves the partial sums to the caller, which adds more partial sums (a
    mixture-of-experts block: shared expert plus routed experts) before one all-reduce.
    """

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel = SINGLE, reduce: bool = True,
                 weight_dtype: torch.dtype | None = None):
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"{in_features} input features do not split over {tp.size} ranks")
        self.tp = tp
        self.reduce = reduce
        self.local_in = in_features // tp.size
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in, dtype=weight_dtype), requires_grad=False)
        self.batch_invariant = False

    def weight_loader(self, param: nn.Parameter, source: TensorSource, shard: str | None = None) -> None:
        check_full(source, 1, self.local_in * self.tp.size)
        copy_checked(param, narrow(source, 1, self.tp.rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            out = invariant.linear(x, self.weight)
            return self.tp.ordered_sum(out) if self.reduce else out
        out = dense.linear(x, self.weight)
        return self.tp.all_reduce(out) if self.reduce else out


class GatheredRowLinear(ColumnParallelLinear):
    """A row-parallel projection (``o_proj``, a dense MLP's ``down_proj``) computed as one rank computes it: the ranks'
    slices of the input are gathered, each rank computes its slice of the output features from the whole input, and
    the output slices are gathered (:attr:`TensorParallel.gathered_rows`: ``--batch-invariant`` under expert
    parallelism). An all-reduce, even in a fixed order, adds partial sums over slices of the input, rounding as no
    single GEMM does; here every output element is one GEMM over the whole input, so the layer's bits are one rank's
    wherever a GEMM's columns do not depend on the columns beside it (as the column-parallel layers already need).
    Two all-gathers replace the all-reduce: about the same bytes. A rank holds ``out / tp`` rows of the whole
    weight instead of ``in / tp`` columns of every row.

    The input is gathered by a forward pre-hook, so that :meth:`forward` and the forward hooks after it (a LoRA
    adapter's, :func:`.lora.shards.lora_shard`) see the whole input beside the whole output, as on one rank: an
    adapter's delta is then one rank's too."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, weight_dtype: torch.dtype | None = None):
        super().__init__(in_features, {"out": (out_features, 1)}, tp=tp, weight_dtype=weight_dtype)
        self.register_forward_pre_hook(_gather_input)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole output from the whole input ``x`` (gathered by the pre-hook)."""
        return self.tp.all_gather_last_dim(super().forward(x))


def _gather_input(module: GatheredRowLinear, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A :class:`GatheredRowLinear`'s input, the ranks' slices gathered whole."""
    return (module.tp.all_gather_last_dim(args[0]), *args[1:])


class ReplicatedLinear(nn.Module):
    """A small projection every rank holds whole (a router, a gate)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant.linear(x, self.weight)
        return dense.linear(x, self.weight)


class LayerBuilder(Protocol):
    """What a block built of linear layers asks of the model's builder (:class:`.linears.Linears`, or its FP8
    subclass): a layer for each checkpoint name, quantized where the model's quantization config says so. Named here,
    beneath the builders, so that the blocks take any builder and import none."""

    def column(self, name: str, parts: tuple[str, ...], in_features: int, shards: dict[str, tuple[int, int]],
               bias: bool = False, tp: TensorParallel = SINGLE) -> ColumnParallelLinear:
        """A column-parallel layer fusing ``parts`` (the checkpoint's projections under ``name``)."""

    def row(self, name: str, in_features: int, out_features: int, tp: TensorParallel = SINGLE,
            reduce: bool = True) -> RowParallelLinear | GatheredRowLinear:
        """A row-parallel layer (``reduce=False``: its partial sums left to the caller)."""


class GatedMLP(nn.Module):
    """SwiGLU MLP: fused gate/up projection split by columns, down projection by rows (``linears`` builds
    them, ``name`` is the MLP's Hugging Face module name)."""

    def __init__(self, hidden_size: int, intermediate_size: int, silu_and_mul: Callable, linears: LayerBuilder,
                 name: str, tp: TensorParallel = SINGLE, reduce: bool = True):
        super().__init__()
        size = intermediate_size
        self.gate_up_proj = linears.column(name, ("gate_proj", "up_proj"), hidden_size,
                                           {"gate": (size, 1), "up": (size, 1)}, tp=tp)
        self.down_proj = linears.row(f"{name}.down_proj", size, hidden_size, tp=tp, reduce=reduce)
        self.silu_and_mul = silu_and_mul

    def use_invariant_ops(self) -> None:
        self.silu_and_mul = invariant.silu_and_mul

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(hidden)))


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; ranks fill only ids they own, then all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * self.rows_per_rank
        self.local_rows = max(0, min(self.rows_per_rank, vocab_size - self.start))
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size), requires_grad=False)
        self.batch_invariant = False

    def weight_loader(self, param: nn.Parameter, source: TensorSource, shard: str | None = None) -> None:
        check_full(source, 0, self.vocab_size)
        piece = narrow(source, 0, self.start, self.local_rows)
        copy_checked(param.narrow(0, 0, self.local_rows), piece)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(token_ids, self.weight)
        local = token_ids - self.start
        owned = (local >= 0) & (local < self.local_rows)
        out = nn.functional.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        out = out * owned.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection split by vocabulary rows; logits are gathered to full width."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        linear = invariant.linear if self.batch_invariant else dense.linear
        logits = linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits[..., : self.vocab_size]
        return self.tp.all_gather_last_dim(logits)[..., : self.vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, norm: Callable, fused_add_norm: Callable):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self._norm = norm
        self._fused_add_norm = fused_add_norm

    def use_invariant_ops(self) -> None:
        """``transformers``' RMSNorm op for op (the kernels' norms may order the sum differently)."""
        self._norm = invariant.rms_norm
        self._fused_add_norm = invariant.fused_add_rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``, or with a residual ``(norm(x + residual), x + residual)`` in one pass."""
        if residual is None:
            return self._norm(x, self.weight, self.eps)
        return self._fused_add_norm(x, residual, self.weight, self.eps)


def rotary_cos_sin(head_dim: int, max_positions: int, rope: RopeConfig, dtype: torch.dtype = torch.float32
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``[max_positions, head_dim // 2]`` in ``dtype``, with Llama 3 / linear scaling: computed
    in float32, then cast. The rotary kernels compute in the tables' dtype, so a model's own tables are in the model
    dtype: ``transformers`` and vLLM cast ``cos``/``sin`` to it and rotate in it.

    Under a ``meta`` device (a model built for its shapes alone: refit's checks, a rank's layout) the tables are
    shapes too: arithmetic on meta tensors goes through ``torch._refs``, whose first call imports ``torch._dynamo``
    (about 2 s of CPU in each engine process that checks a refit)."""
    if torch.get_default_device().type == "meta":
        return torch.empty(max_positions, head_dim // 2, dtype=dtype), torch.empty(max_positions, head_dim // 2,
                                                                                    dtype=dtype)
    freqs = rotary_angles(head_dim, max_positions, rope)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def invariant_rotary_cos_sin(head_dim: int, max_positions: int, rope: RopeConfig, dtype: torch.dtype
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``[max_positions, head_dim]`` (both halves) in ``dtype``, as ``transformers``
    computes them for every forward: the same angles, ``cos``/``sin`` through the invariant ops, then cast."""
    freqs = rotary_angles(head_dim, max_positions, rope)
    full = torch.cat((freqs, freqs), dim=-1)
    return invariant.cos(full).to(dtype), invariant.sin(full).to(dtype)


def rotary_angles(head_dim: int, max_positions: int, rope: RopeConfig) -> torch.Tensor:
    """float32 rotary angles ``[max_positions, head_dim // 2]``: position times inverse frequency."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    return torch.outer(positions, inv_freq)


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 frequency rescaling: long wavelengths slowed by ``factor``, short kept, a smooth band between."""
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)
