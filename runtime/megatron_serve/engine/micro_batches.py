"""A step's requests in micro-batches across pipeline stages (``--pipeline-micro-batches``), GPipe's schedule at the
size of one step: stage ``s`` runs micro-batch ``m`` while stage ``s - 1`` runs ``m + 1``
(:meth:`~megatron_serve.model.llama.LlamaModel.pipelined`), so that with ``M`` micro-batches over ``P`` stages a
step takes about ``(M + P - 1) / (M x P)`` of the time the stages take one after another on the whole batch.

A micro-batch is a run of whole requests of the step (decode rows first, then prefill chunks, as the step packs
them), of about equal token counts: each request's attention reads only its own blocks, so a micro-batch's attention
is its requests' rows of the whole step's. Every rank splits its plan alike (the plan is the same on every rank).
"""

from __future__ import annotations

import numpy as np

from ..model.attention import AttentionMetadata, ForwardContext
from .step_plan import StepBuffers, StepPlan


def request_bounds(token_counts: np.ndarray, count: int) -> list[int]:
    """Where ``count`` runs of requests (with these token counts, in step order) begin and end: the first requests
    whose cumulative tokens reach each ``k / count`` of the step's, at least one request each (fewer runs when the
    step has fewer requests)."""
    count = min(count, len(token_counts))
    cumulative = np.cumsum(token_counts)
    bounds = [0]
    for part in range(1, count):
        cut = int(np.searchsorted(cumulative, cumulative[-1] * part / count)) + 1
        cut = min(max(cut, bounds[-1] + 1), len(token_counts) - (count - part))
        bounds.append(cut)
    bounds.append(len(token_counts))
    return bounds


def micro_batches(buffers: StepBuffers, plan: StepPlan, context: ForwardContext, count: int
                  ) -> list[tuple[slice, ForwardContext]]:
    """The step's rows and context in at most ``count`` micro-batches of whole requests (one: the step itself)."""
    whole = [(slice(0, plan.num_tokens), context)]
    if count == 1 or plan.num_requests < 2 or plan.multimodal or context.routing is not None or plan.lora:
        return whole  # (stages serve none of the last three: the step stays whole rather than split them)
    decode, prefill = plan.num_decode, plan.num_prefill
    starts = buffers.np["query_start"][: prefill + 1].astype(np.int64)
    first_rows = np.concatenate([np.arange(decode), decode + starts])  # each request's first row, then the end
    bounds = request_bounds(np.diff(first_rows), count)
    return [(slice(int(first_rows[a]), int(first_rows[b])),
             ForwardContext(_metadata(buffers, plan, a, b, int(starts[max(a - decode, 0)])), context.kv_caches))
            for a, b in zip(bounds, bounds[1:])]


def _metadata(buffers: StepBuffers, plan: StepPlan, first: int, end: int, query_offset: int) -> AttentionMetadata:
    """Requests ``first .. end - 1`` of the step as a batch of their own (views of the device buffers; the
    prefill chunks' offsets made relative to the micro-batch's first chunk)."""
    dev, decode = buffers.dev, plan.num_decode
    tables = dev["block_tables"][: plan.num_requests, : plan.block_width]
    decodes = range(min(first, decode), min(end, decode))
    chunks = range(max(first, decode) - decode, max(end, decode) - decode)
    start_row = first if first < decode else decode + query_offset
    end_row = end if end <= decode else decode + int(buffers.np["query_start"][chunks.stop])
    return AttentionMetadata(
        slot_mapping=dev["slots"][start_row:end_row],
        num_decode_tokens=len(decodes),
        decode_block_tables=tables[decodes.start:decodes.stop] if decodes else None,
        decode_context_lens=dev["seq_lens"][decodes.start:decodes.stop] if decodes else None,
        prefill_block_tables=tables[decode + chunks.start:decode + chunks.stop] if chunks else None,
        prefill_query_start_loc=(dev["query_start"][chunks.start:chunks.stop + 1] - query_offset) if chunks else None,
        prefill_context_lens=dev["seq_lens"][decode + chunks.start:decode + chunks.stop] if chunks else None,
    )
