"""The FP8 number format the engine stores weights and KV in, and its scaling, in plain PyTorch.

Every FP8 tensor here is ``float8_e4m3fn`` (largest finite value 448, no infinities) paired with
float32 scales: the real value is ``fp8 * scale``. Scales come at one of these granularities:

* weights, ``block=None``: one scale per output row, ``[N, 1]`` (a checkpoint's per-tensor scale is
  spread over the rows of its tensor, which is exact);
* weights, ``block=(bn, bk)``: one scale per ``bn x bk`` tile, ``[ceil(N / bn), ceil(K / bk)]``
  (block-wise checkpoints: Qwen3-*-FP8, DeepSeek-V3; compressed-tensors ``FP8_BLOCK``);
* activations: one scale per row (per token), or per ``group`` columns of a row (the activation
  side of block-wise weights), computed from the row's largest magnitude at run time;
* KV cache: one scale per (token, KV head), also from the largest magnitude.

The loader quantizes bf16 weights with these functions (``--quantization fp8``, a trainer's
weights arriving into an FP8 engine), the reference kernels dequantize with them, and the Triton
kernels are tested against them.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest scale written: keeps an all-zero row or tile finite (its values quantize to 0 anyway).
MIN_SCALE = 1e-12

Block = tuple[int, int] | None  # (rows, columns) of one weight scale, None = one scale per row


def scale_shape(rows: int, columns: int, block: Block) -> tuple[int, int]:
    """The shape of the scales of a ``[rows, columns]`` weight quantized with ``block``."""
    if block is None:
        return rows, 1
    return -(-rows // block[0]), -(-columns // block[1])


def expand_scales(scale: torch.Tensor, rows: int, columns: int, block: Block) -> torch.Tensor:
    """Scales ``[..., R, C]`` repeated to one per element of a ``[..., rows, columns]`` weight."""
    if block is None:
        return scale.expand(*scale.shape[:-1], columns)
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :rows, :columns]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: Block, dtype: torch.dtype) -> torch.Tensor:
    """``weight * scale`` computed in float32, rounded once to ``dtype``.

    The one definition of an FP8 weight's value: the reference path, the engine on dequantized
    weights and the tests all use it, so they agree bit for bit.
    """
    rows, columns = weight.shape[-2:]
    return (weight.float() * expand_scales(scale.float(), rows, columns, block)).to(dtype)


def quantize(weight: torch.Tensor, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, float32 scales)`` of a floating-point weight ``[..., N, K]``: each row (or tile)
    scaled so that its largest magnitude becomes 448."""
    rows, columns = weight.shape[-2:]
    if weight.is_meta:  # shapes only (a refit's verify step): the meta ops' Python references import torch._dynamo
        scale_rows, scale_columns = scale_shape(rows, columns, block)  # (2 s of CPU in each engine rank)
        return (torch.empty(weight.shape, dtype=FP8_DTYPE, device="meta"),
                torch.empty((*weight.shape[:-2], scale_rows, scale_columns), dtype=torch.float32, device="meta"))
    w = weight.float()
    if block is None:
        amax = w.abs().amax(dim=-1, keepdim=True)
    else:
        bn, bk = block
        r, c = scale_shape(rows, columns, block)
        padded = torch.nn.functional.pad(w.abs(), (0, c * bk - columns, 0, r * bn - rows))
        amax = padded.unflatten(-1, (c, bk)).unflatten(-3, (r, bn)).amax(dim=(-3, -1))
    scale = (amax / FP8_MAX).clamp_min(MIN_SCALE)
    quantized = (w / expand_scales(scale, rows, columns, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def quantize_rows(x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``[M, K]`` to ``(fp8, float32 scales)``: scales ``[M, 1]`` per row, ``[M, ceil(K / group)]``
    per ``group`` columns, or the one ``static_scale`` a checkpoint calibrated (``[1, 1]``)."""
    x32 = x.float()
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1)
        return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    quantized, scale = quantize(x32, None if group is None else (1, group))
    return quantized, scale


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys or values ``[T, H, D]`` to ``(fp8 [T, H, D], float32 scales [T, H])``, one scale per token and head."""
    quantized, scale = quantize(x, None)
    return quantized, scale.squeeze(-1)
