"""Paged attention over the KV cache, and the per-step metadata that describes the packed batch.

A step packs decode tokens first (one per sequence) and prefill chunks after them; decode and
prefill run through different kernels because their shapes differ so much.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_kernels import get_op


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64 cache slot of every token of the step
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [D] int32, including this step's token
    prefill_block_tables: torch.Tensor | None  # [P, max_blocks] int32
    prefill_query_start_loc: torch.Tensor | None  # [P + 1] int32, offsets into the prefill tokens
    prefill_context_lens: torch.Tensor | None  # [P] int32, including this step's chunk


@dataclass
class MultimodalStep:
    """A step's image inputs (vision-language models): embeddings that replace the placeholder tokens'
    and, for multimodal rotary models, three positions per token."""

    image_rows: torch.Tensor | None  # [N] int64 rows of the step's tokens that are image placeholders
    image_embeddings: torch.Tensor | None  # [N, hidden]
    mrope_positions: torch.Tensor | None  # [3, T] int64 (temporal, height, width)


@dataclass
class ForwardContext:
    """What every layer needs besides hidden states: the batch layout and its own cache pages.

    ``routing``, when a list, collects the expert ids ``[T, top_k]`` of every mixture-of-experts
    layer in layer order (routing replay).
    """

    metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, ...]]  # per layer (k, v), or (k, v, k_scales, v_scales) when FP8
    multimodal: MultimodalStep | None = None
    routing: list[torch.Tensor] | None = None


class PagedAttention(nn.Module):
    def __init__(self, layer_index: int, scale: float, device: torch.device):
        super().__init__()
        self.layer_index = layer_index
        self.scale = scale
        self._rotate_and_store = get_op("apply_rotary_write_kv_cache", device)
        self._decode = get_op("paged_attention_decode", device)
        self._prefill = get_op("paged_attention_prefill", device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """Rotate ``q``/``k`` by position, store ``k``/``v`` in the cache (one fused kernel), then attend."""
        meta = context.metadata
        k_cache, v_cache, *fp8_scales = context.kv_caches[self.layer_index]
        scales = dict(zip(("k_scales", "v_scales"), fp8_scales))  # an FP8 cache's (see KVCachePool)
        q, _ = self._rotate_and_store(q, k, v, positions, cos, sin, k_cache, v_cache, meta.slot_mapping, **scales)
        num_decode = meta.num_decode_tokens
        if num_decode == q.shape[0]:
            return self._decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale,
                                **scales)
        if num_decode == 0:
            return self._prefill(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                                 meta.prefill_context_lens, self.scale, **scales)
        out = torch.empty_like(q)
        out[:num_decode] = self._decode(q[:num_decode], k_cache, v_cache, meta.decode_block_tables,
                                        meta.decode_context_lens, self.scale, **scales)
        out[num_decode:] = self._prefill(q[num_decode:], k_cache, v_cache, meta.prefill_block_tables,
                                         meta.prefill_query_start_loc, meta.prefill_context_lens, self.scale, **scales)
        return out
