"""A mixture-of-experts layer's expert weights as every ``fused_moe`` takes them: the stacked projections and,
for FP8 experts, their scales and the scale block.

Every ``fused_moe`` (the reference, the Triton kernel, the batch-invariant one) takes the five as one value,
checked against a call's tokens and dequantized here, so the implementations agree on what they accept and on
how FP8 experts read. Only torch here: the reference takes it without Triton installed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .fp8 import Block, dequantize


class ExpertWeights(NamedTuple):
    """``w13`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``w2`` ``[E, H, I]``. FP8 experts
    (``float8_e4m3fn``) come with ``w13_scale`` / ``w2_scale`` ``[E, ...]``, one scale per row (``block=None``)
    or per ``block`` tile (:mod:`megatron_kernels.fp8`)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    block: Block = None

    @property
    def fp8(self) -> bool:
        """Whether the experts are FP8 values with their scales."""
        return self.w13_scale is not None

    def check(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Refuse weights that do not fit ``hidden`` ``[T, H]``, and routing that is not ``[T, k]`` twice."""
        num_tokens, hidden_size = hidden.shape
        num_experts, two_i, w13_k = self.w13.shape
        if w13_k != hidden_size or self.w2.shape != (num_experts, hidden_size, two_i // 2) or two_i % 2:
            raise ValueError(f"expert weights w13 {tuple(self.w13.shape)} / w2 {tuple(self.w2.shape)} do not fit "
                             f"hidden {tuple(hidden.shape)}")
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
            raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                             f"must both be [{num_tokens}, k]")

    def dequantized(self, experts: int | torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate/up and down weights of ``experts`` (one id, or a tensor of ids): FP8 ones dequantized to
        ``dtype``, plain ones as they are stored."""
        gate_up, down = self.w13[experts], self.w2[experts]
        if self.w13_scale is None:
            return gate_up, down
        return (dequantize(gate_up, self.w13_scale[experts], self.block, dtype),
                dequantize(down, self.w2_scale[experts], self.block, dtype))
