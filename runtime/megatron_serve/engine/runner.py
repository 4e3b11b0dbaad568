"""Turns a scheduled batch into model inputs, runs the forward pass, and returns logits to sample.

A step is first described as a ``StepPlan`` of plain integer lists (cheap to send to the other
tensor-parallel ranks), then turned into tensors on each rank's device. Only rows that sample
(decode tokens, and prefill chunks that reach the end of their sequence) go through the LM head,
plus, for requests that asked for prompt log probs, the prompt positions that predict the next
prompt token (``score_rows``; their logits follow the sampling rows').
Decode-only steps replay a captured CUDA graph when the runner has them (see ``cuda_graphs``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .graphs import DecodeGraphs
from ..model.attention import AttentionMetadata, ForwardContext, MultimodalStep
from ..model.llama import LlamaForCausalLM
from ..model.moe import stack_routing
from .scheduler import Sequence

if TYPE_CHECKING:
    from .encoder_cache import StepImages
    from ..weights.sources import WeightSource

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    decode_block_tables: list[list[int]]
    decode_context_lens: list[int]
    prefill_block_tables: list[list[int]]
    prefill_query_start: list[int]
    prefill_context_lens: list[int]
    sample_rows: list[int]
    score_rows: list[int] = field(default_factory=list)
    image_rows: list[int] = field(default_factory=list)  # rows whose embeddings come with the step
    mrope_positions: list[list[int]] | None = None  # [3][T] multimodal rotary positions
    record_routing: bool = False  # some sequence records its expert routing (routing replay)

    @property
    def multimodal(self) -> bool:
        return bool(self.image_rows) or self.mrope_positions is not None


@dataclass
class StepResult:
    """float32 logits ``[sampling rows + score rows, vocab]`` in entry order; with ``record_routing``
    also the expert ids ``[step tokens, moe layers, top_k]`` of every token of the step (small integer dtype)."""

    logits: torch.Tensor
    routing: torch.Tensor | None = None


def prompt_positions_to_score(sequence: Sequence, count: int) -> range:
    """Positions of this step's chunk whose logits score the next prompt token and are not scored yet.

    Position ``p`` predicts prompt token ``p + 1``; positions scored before a preemption are not
    scored again when the request is recomputed.
    """
    request = sequence.request
    if not request.prompt_scores_missing:
        return range(0)
    start = sequence.num_computed
    return range(max(start, len(request.prompt_log_probs)), min(start + count, len(request.prompt_tokens) - 1))


def _padded(tables: list[list[int]]) -> list[list[int]]:
    width = max(len(t) for t in tables)
    return [t + [0] * (width - len(t)) for t in tables]


def plan_step(entries: list[tuple[Sequence, int]], block_size: int, images: StepImages | None = None) -> StepPlan:
    """Describe one step; ``entries`` come decode-shaped (one token) first, as the scheduler orders them.

    ``images``: the step's image inputs (vision-language models), which also set the rotary positions.
    """
    plan = StepPlan([], [], [], [], [], [], [0], [], [])
    for sequence, count in entries:
        plan.record_routing = plan.record_routing or sequence.routing is not None
        start = sequence.num_computed
        first_row = len(plan.token_ids)
        plan.token_ids.extend(sequence.token_ids[start : start + count])
        plan.score_rows.extend(first_row + p - start for p in prompt_positions_to_score(sequence, count))
        table = sequence.block_table
        for position in range(start, start + count):
            plan.positions.append(position)
            plan.slots.append(table[position // block_size] * block_size + position % block_size)
        if start + count == len(sequence.token_ids):
            plan.sample_rows.append(len(plan.token_ids) - 1)
        if count == 1:
            plan.decode_block_tables.append(table)
            plan.decode_context_lens.append(start + 1)
        else:
            plan.prefill_block_tables.append(table)
            plan.prefill_query_start.append(plan.prefill_query_start[-1] + count)
            plan.prefill_context_lens.append(start + count)
    if plan.decode_block_tables:
        plan.decode_block_tables = _padded(plan.decode_block_tables)
    if plan.prefill_block_tables:
        plan.prefill_block_tables = _padded(plan.prefill_block_tables)
    if images is not None:
        plan.image_rows = images.rows
        plan.mrope_positions = images.mrope_positions
        if images.positions is not None:
            plan.positions = images.positions
    return plan


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, block_size: int, device: torch.device,
                 decode_graphs: DecodeGraphs | None = None):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.decode_graphs = decode_graphs

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor | None:
        return torch.tensor(values, dtype=dtype, device=self.device) if values else None

    def metadata(self, plan: StepPlan) -> AttentionMetadata:
        has_prefill = bool(plan.prefill_block_tables)
        return AttentionMetadata(
            slot_mapping=self._tensor(plan.slots, torch.int64),
            num_decode_tokens=len(plan.decode_context_lens),
            decode_block_tables=self._tensor(plan.decode_block_tables, torch.int32),
            decode_context_lens=self._tensor(plan.decode_context_lens, torch.int32),
            prefill_block_tables=self._tensor(plan.prefill_block_tables, torch.int32),
            prefill_query_start_loc=self._tensor(plan.prefill_query_start, torch.int32) if has_prefill else None,
            prefill_context_lens=self._tensor(plan.prefill_context_lens, torch.int32),
        )

    def multimodal_step(self, plan: StepPlan, image_embeddings: torch.Tensor | None) -> MultimodalStep | None:
        if not plan.multimodal:
            return None
        return MultimodalStep(self._tensor(plan.image_rows, torch.int64), image_embeddings,
                              self._tensor(plan.mrope_positions, torch.int64))

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 image_embeddings: torch.Tensor | None = None) -> StepResult:
        """Run one step: float32 logits of the sampling and score rows, and the expert routing when the plan
        records it.

        ``image_embeddings``: one row per ``plan.image_rows`` (vision-language models).
        """
        if (self.decode_graphs is not None and not plan.score_rows and not plan.multimodal
                and self.decode_graphs.covers(plan)):
            return StepResult(*self.decode_graphs.run(plan))
        context = ForwardContext(self.metadata(plan), kv_caches, self.multimodal_step(plan, image_embeddings),
                                 [] if plan.record_routing else None)
        hidden = self.model(self._tensor(plan.token_ids, torch.int64), self._tensor(plan.positions, torch.int64),
                            context)
        routing = stack_routing(context.routing, self.model.config) if plan.record_routing else None
        rows = plan.sample_rows + plan.score_rows
        if not rows:  # only partial prefill chunks this step: nothing to sample
            return StepResult(hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32), routing)
        return StepResult(self.model.compute_logits(hidden[self._tensor(rows, torch.int64)]), routing)

    def execute(self, entries: list[tuple[Sequence, int]], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                images: StepImages | None = None) -> StepResult:
        return self.run_plan(plan_step(entries, self.block_size, images), kv_caches,
                             None if images is None else images.embeddings)

    def capture_graphs(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Capture the decode graphs over a newly allocated KV pool (engine start, resume).

        A failed capture costs speed, not service: a single rank goes on without graphs. Tensor-parallel
        ranks must capture in lockstep (their warm-up runs all-reduce), so there it is an error.
        """
        if self.decode_graphs is None:
            return
        try:
            self.decode_graphs.capture(kv_caches)
        except Exception as exc:  # noqa: BLE001 - any capture failure has the same remedy
            self.decode_graphs.release()
            if self.model.tp.size > 1:
                raise RuntimeError(f"capturing decode CUDA graphs failed ({exc}); "
                                   "start the engine with --no-cuda-graphs") from exc
            logger.warning("capturing decode CUDA graphs failed, decoding eagerly from now on: %s", exc)
            self.decode_graphs = None

    def on_suspend(self, level: int) -> None:
        """Release the decode graphs before the pool they point into is freed."""
        if self.decode_graphs is not None:
            self.decode_graphs.release()

    # Hooks for runners that drive other ranks; a single-rank runner has nothing to tell anyone.

    def on_resume(self) -> None:
        pass

    def on_refit(self, source: "WeightSource") -> None:
        pass

    def refit_outcomes(self) -> list[tuple[list[str], str | None]]:
        """Each other rank's part of the refit just run: the names it loaded, and its error if any."""
        return []

    def shutdown(self) -> None:
        pass
