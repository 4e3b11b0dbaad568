"""Linear layers and experts with FP8 weights: what they hold, and how checkpoint tensors fill them.

An FP8 layer holds ``weight`` (e4m3, the plain layer's shape), ``weight_scale`` (float32, one per
output row or per block: :mod:`megatron_kernels.fp8`) and, for checkpoints with calibrated
activation scales, ``input_scale`` (one per fused part; the GEMM takes their maximum). A checkpoint
tensor for the weight arrives in one of two forms:

* **FP8 data** (a pre-quantized checkpoint): copied as is; its scale arrives as its own tensor
  (``weight_scale``, or ``weight_scale_inv`` of block-wise checkpoints: the same multiplier),
  per tensor (spread over the part's rows), per row, or per block;
* **floating point** (``--quantization fp8``, a trainer's bf16 weights through ``WeightSender``, a
  bf16 refit directory): quantized on arrival with the layer's own scheme, which fills the weight
  and its scales at once (``weight_loader`` says so, and the loader counts both as loaded). Per-row
  scales always come from whole rows, so a tensor-parallel rank quantizes exactly as one GPU does.

Scales that are NaN, infinite or not positive, FP8 data holding NaN codes, and shapes that do not
fit are refused naming the tensor (the loader adds the name). Block-wise layouts need every
tensor-parallel slice and every fused part to start on a block boundary; that is checked when the
layer is built.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron_kernels import get_op, invariant_fp8
from megatron_kernels.fp8 import FP8_DTYPE, Block, quantize, scale_shape
from megatron_kernels.moe_weights import ExpertWeights

from .errors import UnsupportedModelError
from .layers import ColumnParallelLinear, GatheredRowLinear, RowParallelLinear
from .linears import PLAIN_LINEARS, Linears
from .experts.moe import FusedExperts
from .parallel import SINGLE, TensorParallel
from .quantization import Fp8Scheme, QuantizationConfig
from .tensor_source import TensorSource, check_full, copy_checked, is_fp8, narrow, read_all, shape_of

Span = tuple[int, int]  # (start, length) along one dimension


def _checked_scales(scales: torch.Tensor) -> torch.Tensor:
    """Scales as float32, refused when one is NaN, infinite, zero or negative (meta tensors carry no values)."""
    scales = scales.float()
    if scales.device.type != "meta":
        bad = ~(torch.isfinite(scales) & (scales > 0))
        if bool(bad.any()):
            raise ValueError(f"scale holds {int(bad.sum())} value(s) that are NaN, infinite or not positive "
                             f"(first: {scales[bad][0].item()})")
    return scales


def _checked_fp8(data: torch.Tensor) -> torch.Tensor:
    """FP8 weight data, refused when it holds NaN codes (e4m3 has no infinities)."""
    if data.device.type != "meta":
        nan = (data.view(torch.uint8) & 0x7F) == 0x7F
        if bool(nan.any()):
            raise ValueError(f"FP8 data holds {int(nan.sum())} NaN value(s)")
    return data


def fill_weight(weight: torch.Tensor, scales: torch.Tensor, source: TensorSource, rows: Span, cols: Span,
                block: Block) -> bool:
    """Fill ``weight`` (the target ``[..., rows, cols]`` region) from that region of ``source``.

    FP8 data is copied; floating-point data is quantized, which fills ``scales`` too (returns True).
    """
    if is_fp8(source):
        copy_checked(weight, _checked_fp8(narrow(narrow(source, -2, *rows), -1, *cols)))
        return False
    whole_rows = block is None and cols[1] != shape_of(source)[-1]  # per-row scales need the whole row
    values = narrow(source, -2, *rows)
    if not whole_rows:
        values = narrow(values, -1, *cols)
    quantized, scale = quantize(values, block)
    copy_checked(weight, quantized.narrow(-1, *cols) if whole_rows else quantized)
    copy_checked(scales, scale)
    return True


def fill_scales(scales: torch.Tensor, source: TensorSource, rows: Span, cols: Span, full: tuple[int, int],
                block: Block) -> None:
    """Fill ``scales`` (those of the weight region ``rows`` x ``cols`` of a ``full`` ``[R, C]`` weight).

    Per-row layouts take one scale per tensor (spread over the rows) or one per row; block layouts
    one per block of the full weight.
    """
    lead = tuple(scales.shape[:-2])
    shape = shape_of(source)
    if block is None:
        if math.prod(shape) == math.prod(lead):  # per tensor
            value = _checked_scales(read_all(source)).reshape(*lead, 1, 1)
            scales.copy_(value.expand_as(scales))
            return
        if shape not in ((*lead, full[0], 1), (*lead, full[0])):
            raise ValueError(f"scale shape {shape} does not fit: want one per tensor, or {(*lead, full[0], 1)} "
                             "(one per row)")
        piece = narrow(source, len(lead), *rows).reshape(*lead, rows[1], 1)
    else:
        want = (*lead, *scale_shape(*full, block))
        if shape != want:
            raise ValueError(f"scale shape {shape} does not fit: want {want} ({block[0]}x{block[1]} blocks of "
                             f"{full[0]}x{full[1]})")
        bn, bk = block
        piece = narrow(source, -2, rows[0] // bn, -(-rows[1] // bn))
        piece = narrow(piece, -1, cols[0] // bk, -(-cols[1] // bk))
    copy_checked(scales, _checked_scales(piece))


def _input_scale(source: TensorSource) -> torch.Tensor:
    value = read_all(source)
    if value.numel() != 1:
        raise ValueError(f"input_scale has shape {tuple(value.shape)}: want one value per tensor")
    return _checked_scales(value).reshape(())


def _check_block_span(name: str, start: int, length: int, full: int, size: int, what: str) -> None:
    """A block-wise slice must start on a block boundary and hold whole blocks (the last may be ragged only
    at the tensor's end)."""
    if start % size or (length % size and start + length != full):
        raise UnsupportedModelError(f"{name}: {what} {start}..{start + length} of {full} do not fall on the "
                                    f"{size}-wide weight scale blocks (tensor parallelism must split whole blocks)")


def _block_rows(scales: torch.Tensor, block: Block, offset: int, length: int) -> torch.Tensor:
    """The scale rows of weight rows ``offset .. offset + length`` (a fused part)."""
    if block is None:
        return scales.narrow(-2, offset, length)
    return scales.narrow(-2, offset // block[0], -(-length // block[0]))


def _scale_parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)


class Fp8ColumnParallelLinear(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` with FP8 weights; fused parts keep their own scales."""

    def __init__(self, in_features: int, shards: dict[str, tuple[int, int]], bias: bool, tp: TensorParallel,
                 scheme: Fp8Scheme, name: str):
        super().__init__(in_features, shards, bias, tp, weight_dtype=FP8_DTYPE)
        self.block = scheme.block
        rows = self.weight.shape[0]
        if self.block is not None:
            for part, (offset, start, length) in self.slices.items():
                _check_block_span(f"{name} ({part})", start, length, self.features[part], self.block[0], "rows")
                _check_block_span(f"{name} ({part})", offset, length, rows, self.block[0], "fused rows")
        self.weight_scale = _scale_parameter(*scale_shape(rows, in_features, self.block))
        self.input_scale = _scale_parameter(len(self.slices)) if scheme.static_input_scale else None
        self._fp8_linear = get_op("fp8_linear", self.weight.device)

    def weight_loader(self, param: nn.Parameter, source: TensorSource, shard: str | None = None
                      ) -> tuple[str, ...]:
        """Load one part of the weight, its scales or its input scale; names the sibling parameters a
        floating-point weight filled as well (its scales)."""
        if param is self.bias:
            super().weight_loader(param, source, shard)
            return ()
        name = shard if shard is not None else next(iter(self.slices))
        offset, start, length = self.slices[name]
        cols = (0, self.weight.shape[1])
        scales = _block_rows(self.weight_scale.data, self.block, offset, length)
        if param is self.input_scale:
            param.data[list(self.slices).index(name)] = _input_scale(source)
            return ()
        if param is self.weight_scale:
            fill_scales(scales, source, (start, length), cols, (self.features[name], cols[1]), self.block)
            return ()
        check_full(source, 0, self.features[name])
        filled = fill_weight(self.weight.data.narrow(0, offset, length), scales, source, (start, length), cols,
                             self.block)
        return ("weight_scale",) if filled else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant_fp8.fp8_linear(x, self.weight, self.weight_scale, self.block, self.bias)
        input_scale = None if self.input_scale is None else self.input_scale.max()
        return self._fp8_linear(x, self.weight, self.weight_scale, self.block, self.bias, input_scale)


class Fp8RowParallelLinear(RowParallelLinear):
    """:class:`RowParallelLinear` with FP8 weights (per-row scales whole on every rank, block scales split)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, reduce: bool, scheme: Fp8Scheme,
                 name: str):
        super().__init__(in_features, out_features, tp, reduce, weight_dtype=FP8_DTYPE)
        self.block = scheme.block
        if self.block is not None:
            _check_block_span(name, tp.rank * self.local_in, self.local_in, in_features, self.block[1], "columns")
        self.weight_scale = _scale_parameter(*scale_shape(out_features, self.local_in, self.block))
        self.input_scale = _scale_parameter(1) if scheme.static_input_scale else None
        self._fp8_linear = get_op("fp8_linear", self.weight.device)

    def weight_loader(self, param: nn.Parameter, source: TensorSource, shard: str | None = None
                      ) -> tuple[str, ...]:
        rows = (0, self.weight.shape[0])
        cols = (self.tp.rank * self.local_in, self.local_in)
        full = (rows[1], self.local_in * self.tp.size)
        if param is self.input_scale:
            param.data[0] = _input_scale(source)
            return ()
        if param is self.weight_scale:
            fill_scales(self.weight_scale.data, source, rows, cols, full, self.block)
            return ()
        check_full(source, 1, full[1])
        filled = fill_weight(self.weight.data, self.weight_scale.data, source, rows, cols, self.block)
        return ("weight_scale",) if filled else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            out = invariant_fp8.fp8_linear(x, self.weight, self.weight_scale, self.block)
            return self.tp.ordered_sum(out) if self.reduce else out
        input_scale = None if self.input_scale is None else self.input_scale[0]
        out = self._fp8_linear(x, self.weight, self.weight_scale, self.block, None, input_scale)
        return self.tp.all_reduce(out) if self.reduce else out


class Fp8FusedExperts(FusedExperts):
    """:class:`FusedExperts` with FP8 experts: ``gate_up_proj_scale`` / ``down_proj_scale`` beside the
    stacked weights. Experts run weight-only (activations unquantized), so checkpoints' expert
    input scales are not used (the loader skips them)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel,
                 device: torch.device, scheme: Fp8Scheme, name: str):
        super().__init__(num_experts, hidden_size, intermediate_size, tp, device, weight_dtype=FP8_DTYPE)
        self.block = scheme.block
        local, count = self.local, self.num_local_experts
        if self.block is not None:
            bn, bk = self.block
            _check_block_span(f"{name} experts", self.start, local, intermediate_size, bn, "rows")
            _check_block_span(f"{name} experts", local, local, 2 * local, bn, "fused up rows")
            _check_block_span(f"{name} experts", self.start, local, intermediate_size, bk, "columns")
        self.gate_up_proj_scale = _scale_parameter(count, *scale_shape(2 * local, hidden_size, self.block))
        self.down_proj_scale = _scale_parameter(count, *scale_shape(hidden_size, local, self.block))

    def weight_pieces(self, param_name: str) -> frozenset:
        return super().weight_pieces(param_name.removesuffix("_scale"))

    def weight_loader(self, param: nn.Parameter, source: TensorSource, part: str | None = None,
                      expert: int | None = None) -> tuple[str, ...]:
        """One expert's projection (``part``/``expert``) or the whole stack, or their scales, into every slot holding
        it."""
        filled: tuple[str, ...] = ()
        for piece, index in self.local_sources(source, expert):
            filled = self._load_fp8_piece(param, piece, part, index) or filled
        return filled

    def _load_fp8_piece(self, param: nn.Parameter, source: TensorSource, part: str | None, index: int | slice
                        ) -> tuple[str, ...]:
        stacked = isinstance(index, slice)
        size, local, start = self.intermediate_size, self.local, self.start
        hidden = self.down_proj.shape[1]
        down = param is self.down_proj or param is self.down_proj_scale
        weight = self.down_proj if down else self.gate_up_proj
        scales = self.down_proj_scale if down else self.gate_up_proj_scale
        pick = lambda t: t[index]  # noqa: E731
        if down:
            regions = [((0, hidden), (start, local), (hidden, size), pick(weight.data), pick(scales.data))]
        else:
            regions = []
            for name in ("gate", "up") if part is None else (part,):
                offset = 0 if name == "gate" else local
                first_row = start + (size if stacked and name == "up" else 0)
                regions.append(((first_row, local), (0, hidden), (2 * size if stacked else size, hidden),
                                pick(weight.data).narrow(-2, offset, local),
                                _block_rows(pick(scales.data), self.block, offset, local)))
        filled = False
        for rows, cols, full, target, target_scales in regions:
            if param is scales:
                fill_scales(target_scales, source, rows, cols, full, self.block)
                continue
            check_full(source, len(shape_of(source)) - 2, full[0])
            check_full(source, len(shape_of(source)) - 1, full[1])
            filled = fill_weight(target, target_scales, source, rows, cols, self.block) or filled
        return (f"{'down_proj' if down else 'gate_up_proj'}_scale",) if filled else ()

    def expert_weights(self) -> ExpertWeights:
        return ExpertWeights(self.gate_up_proj, self.down_proj, self.gate_up_proj_scale, self.down_proj_scale,
                             self.block)


class Fp8Linears(Linears):
    """Builds FP8 layers where ``quantization`` puts them, plain ones elsewhere."""

    def __init__(self, quantization: QuantizationConfig):
        self.quantization = quantization

    def column(self, name: str, parts: tuple[str, ...], in_features: int, shards: dict[str, tuple[int, int]],
               bias: bool = False, tp: TensorParallel = SINGLE) -> ColumnParallelLinear:
        scheme = self.quantization.fused_scheme(name, parts)
        if scheme is None:
            return super().column(name, parts, in_features, shards, bias, tp)
        return Fp8ColumnParallelLinear(in_features, shards, bias, tp, scheme, name)

    def row(self, name: str, in_features: int, out_features: int, tp: TensorParallel = SINGLE,
            reduce: bool = True) -> RowParallelLinear | GatheredRowLinear:
        scheme = self.quantization.scheme_for(name)
        if scheme is None:
            return super().row(name, in_features, out_features, tp, reduce)
        return Fp8RowParallelLinear(in_features, out_features, tp, reduce, scheme, name)

    def experts(self, name: str, parts: tuple[str, ...], num_experts: int, hidden_size: int, intermediate_size: int,
                tp: TensorParallel, device: torch.device) -> FusedExperts:
        scheme = self.quantization.fused_scheme(name, parts)
        if scheme is None:
            return super().experts(name, parts, num_experts, hidden_size, intermediate_size, tp, device)
        return Fp8FusedExperts(num_experts, hidden_size, intermediate_size, tp, device, scheme, name)


def linears_for(quantization: QuantizationConfig | None) -> Linears:
    """The builder of a model with this quantization (None: unquantized)."""
    return PLAIN_LINEARS if quantization is None else Fp8Linears(quantization)
