"""FP8 weights under ``--batch-invariant``: the weight dequantized (:func:`.fp8.dequantize`, one rounding
per element, the same bits whatever the batch) and the activations left unquantized, then the mode's own
GEMMs (:mod:`.invariant`; FP8 experts: :func:`.invariant.fused_moe` itself).

The default FP8 path is not batch-invariant by construction: on a GPU it picks a weight-only GEMM up to
``WEIGHT_ONLY_MAX_ROWS`` rows and an FP8 x FP8 GEMM (activations quantized) above, splits K for small
batches, and hands row-wise scales to cuBLASLt, so a token's logits change with the step's row count.
Weight-only arithmetic through the invariant GEMM removes every such choice; it also means the mode does
not use FP8 tensor cores (the weights still take FP8's memory, the dequantized copy lives for one call).
``input_scale`` (a checkpoint's static activation scale) only matters where activations are quantized,
so it is not read here.
"""

from __future__ import annotations

import torch

from . import invariant
from .fp8 import Block, dequantize


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: Block,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(W)^T + bias`` with :func:`.invariant.linear`."""
    return invariant.linear(x, dequantize(weight, weight_scale, block, x.dtype), bias)

