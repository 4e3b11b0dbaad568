"""Paged attention over the KV cache, and the per-step metadata that describes the packed batch.

A step packs decode tokens first (one per sequence) and prefill chunks after them; decode and
prefill run through different kernels because their shapes differ so much. Attention is two calls:
``store`` (rotate q and k by position, write k and v into the cache: one fused kernel, shapes only)
and ``attend`` (read the cache with the step's lengths). Piecewise CUDA graphs capture everything
but ``attend``, which then runs eagerly between them with the step's real lengths.

A step may be padded (``metadata.num_tokens`` real rows of more): padding rows write no cache slot
(slot -1) and attend to nothing (their output rows are left as they are, or zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_kernels import get_op, invariant
from megatron_kernels.invariant_attention import PagedStep, Workspace
from megatron_kernels.paged_kv import PagedKV


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64 cache slot of every token of the step (-1: a padding row)
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [D] int32, including this step's token
    prefill_block_tables: torch.Tensor | None  # [P, max_blocks] int32
    prefill_query_start_loc: torch.Tensor | None  # [P + 1] int32, offsets into the prefill tokens
    prefill_context_lens: torch.Tensor | None  # [P] int32, including this step's chunk
    num_tokens: int | None = None  # real rows (decode plus prefill); None: every row of the step


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
    # --batch-invariant on CPU: the forward's attention plan, made by the first layer (a forward's context is its
    # own; its metadata may not be: graph replays rerun over the same metadata with new contents)
    invariant_step: PagedStep | None = None


class PagedAttention(nn.Module):
    def __init__(self, layer_index: int, scale: float, device: torch.device):
        super().__init__()
        self.layer_index = layer_index
        self.scale = scale
        self._rotate_and_store = get_op("apply_rotary_write_kv_cache", device)
        self._decode = get_op("paged_attention_decode", device)
        self._prefill = get_op("paged_attention_prefill", device)
        self._write = get_op("write_kv_cache", device)
        self.batch_invariant = False
        self.workspace: Workspace | None = None  # --batch-invariant on CPU: scratch tensors, one per model

    def _cache(self, context: ForwardContext) -> PagedKV:
        """This layer's keys and values, with an FP8 cache's scales (see ``KVCachePool``)."""
        return PagedKV(*context.kv_caches[self.layer_index])

    def store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """Rotate ``q``/``k`` by position and store ``k``/``v`` in the cache (one fused kernel); returns rotated ``q``."""
        cache = self._cache(context)
        if self.batch_invariant:  # cos/sin: full-width tables in the model dtype (invariant_rotary_cos_sin)
            cos_t, sin_t = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
            self._write(invariant.rotate(k, cos_t, sin_t), v, cache, context.metadata.slot_mapping)
            return invariant.rotate(q, cos_t, sin_t)
        q, _ = self._rotate_and_store(q, k, v, positions, cos, sin, cache, context.metadata.slot_mapping)
        return q

    def attend(self, q: torch.Tensor, context: ForwardContext, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the step's rows over the cache, into ``out`` when given (rows past the real ones untouched)."""
        meta = context.metadata
        cache = self._cache(context)
        rows = q.shape[0] if meta.num_tokens is None else meta.num_tokens
        if out is None:
            out = torch.empty_like(q) if rows == q.shape[0] else torch.zeros_like(q)
        if self.batch_invariant:
            if q.is_cuda:  # the Triton kernel: lengths read on the device, so CUDA graphs can capture it
                from megatron_kernels import triton_invariant_attention  # noqa: PLC0415 - GPU only, needs triton
                triton_invariant_attention.attend_step(q[:rows], meta, cache, self.scale, out[:rows])
                return out
            out[:rows] = self._attend_invariant(q[:rows], context, cache)
            return out
        num_decode = meta.num_decode_tokens
        if num_decode:
            self._decode(q[:num_decode], cache, meta.decode_block_tables, meta.decode_context_lens, self.scale,
                         out=out[:num_decode])
        if num_decode < rows:
            self._prefill(q[num_decode:rows], cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                          meta.prefill_context_lens, self.scale, out=out[num_decode:rows])
        return out

    def _attend_invariant(self, q: torch.Tensor, context: ForwardContext, cache: PagedKV) -> torch.Tensor:
        """Every row of the step through :class:`megatron_kernels.invariant_attention.PagedStep`: decode rows and
        prefill chunks, cold or after a prefix-cache hit, meet the same arithmetic. The forward's plan (row
        groups, cache slots to read) is made by the first layer and kept on ``context`` for the others."""
        step = context.invariant_step
        group_heads, block_size = q.shape[1] // cache.kv_heads, cache.block_size
        if step is None or (step.group_heads, step.block_size) != (group_heads, block_size):
            step = context.invariant_step = _plan_step(context.metadata, group_heads, block_size, q.device)
        if self.workspace is None:
            self.workspace = Workspace()
        return step.attend(q, cache, self.scale, torch.empty_like(q), self.workspace)


def _plan_step(meta: AttentionMetadata, group_heads: int, block_size: int, device: torch.device) -> PagedStep:
    """The step's rows and positions per sequence (decode rows first, one each, then the prefill chunks)."""
    rows_of: list[range] = []
    positions_of: list[range] = []
    tables = []
    decode = meta.num_decode_tokens
    if decode:
        rows_of += [range(row, row + 1) for row in range(decode)]
        positions_of += [range(length - 1, length) for length in meta.decode_context_lens.tolist()]
        tables.append(meta.decode_block_tables)
    if meta.prefill_block_tables is not None:
        starts = meta.prefill_query_start_loc.tolist()
        for index, length in enumerate(meta.prefill_context_lens.tolist()):
            count = starts[index + 1] - starts[index]
            rows_of.append(range(decode + starts[index], decode + starts[index + 1]))
            positions_of.append(range(length - count, length))
        tables.append(meta.prefill_block_tables)
    return PagedStep(rows_of, positions_of, torch.cat(tables) if len(tables) > 1 else tables[0], group_heads,
                     block_size, device)
