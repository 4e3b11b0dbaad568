"""Runs one step's forward pass from the persistent step buffers and returns the logits to sample.

The step is described by a :class:`~megatron_serve.engine.step_plan.StepPlan` whose values sit in
the runner's :class:`~megatron_serve.engine.step_plan.StepBuffers`; the forward reads the device
buffers only. Only rows that sample (decode tokens, and prefill chunks that reach the end of their
sequence) go through the LM head, plus, for requests that asked for prompt log probs, the prompt
positions that predict the next prompt token (their logits follow the sampling rows').

Decode-only steps replay a captured CUDA graph when the runner has them (see ``graphs``); so do
mixed steps up to the largest captured token count, piecewise (``graphs.MixedGraphs``). Either way the
LM head runs here, eagerly, on the rows that need logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..model.attention import AttentionMetadata, ForwardContext, MultimodalStep
from ..model.llama import LlamaForCausalLM
from ..model.experts.moe import empty_moe_pass, stack_routing
from .precompile.graphs import DecodeGraphs, MixedGraphs, StepGraphs
from .kv.copier import Copier, copier_for
from .kv.transfer import NoOtherRanks, OtherRanks
from .micro_batches import micro_batches
from .served import Turn
from .step_plan import StepBuffers, StepPlan
from .precompile.warmup import compile_kernels

if TYPE_CHECKING:
    from ..model.lora.slots import LoraRows
    from .kv.park import ParkOrder
    from ..weights.sources import WeightSource

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """float32 logits ``[sampling rows + score rows + verify rows, vocab]`` in entry order; with ``record_routing``
    also the expert ids ``[step tokens, moe layers, top_k]`` of every token of the step (small integer dtype);
    with a corrected plan (``plan.shifted``) each logits row's shift (int64), by which its sampling position
    and count of generated tokens move back too."""

    logits: torch.Tensor
    routing: torch.Tensor | None = None
    shift: torch.Tensor | None = None


def attention_metadata(buffers: StepBuffers, plan: StepPlan) -> AttentionMetadata:
    """Views of the device buffers that describe the plan's batch to the attention layers."""
    dev, decode, requests = buffers.dev, plan.num_decode, plan.num_requests
    tables = dev["block_tables"][:requests, : plan.block_width]
    has_prefill = plan.num_prefill > 0
    return AttentionMetadata(
        slot_mapping=dev["slots"][: plan.num_tokens],
        num_decode_tokens=decode,
        decode_block_tables=tables[:decode] if decode else None,
        decode_context_lens=dev["seq_lens"][:decode] if decode else None,
        prefill_block_tables=tables[decode:] if has_prefill else None,
        prefill_query_start_loc=dev["query_start"][: plan.num_prefill + 1] if has_prefill else None,
        prefill_context_lens=dev["seq_lens"][decode:requests] if has_prefill else None,
    )


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, block_size: int, device: torch.device, buffers: StepBuffers,
                 graphs: StepGraphs | None = None):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.buffers = buffers
        self.graphs = graphs
        self.lora_rows: LoraRows | None = None  # the adapter slot table's row indices (engine.lora), if any

    def _graphs_for(self, plan: StepPlan, size: int | None = None) -> DecodeGraphs | MixedGraphs | None:
        """The graphs that replay ``plan``: a whole decode step, or a mixed step piecewise; None: eager. ``size``:
        the graph must be of this size (a data-parallel group's padded step)."""
        graphs = self.graphs
        if graphs is None:
            return None
        if plan.lora:  # decode steps with adapter rows have graphs of their own (engine.lora_graphs), if any
            lora = graphs.lora_decode
            return lora if lora is not None and lora.covers(plan, size) else None
        if graphs.decode.covers(plan, size):
            return graphs.decode
        if graphs.mixed is not None and graphs.mixed.covers(plan, size):
            return graphs.mixed
        return None

    def kv_copier(self) -> Copier:
        """How the host KV tier copies blocks between this runner's pool and host memory (a group's rank 0 tells
        its other ranks too)."""
        return copier_for(self.device)

    def kv_others(self) -> OtherRanks:
        """A group's other ranks, which hold parts of every block (a prefilled request's go on with rank 0's)."""
        return NoOtherRanks()

    def padded_size(self, group_tokens: int | None) -> int | None:
        """The graph size a data-parallel group's step pads to on every rank (None: no agreed step, or larger than
        every graph: eager with exact counts)."""
        if group_tokens is None or self.graphs is None:
            return None
        return self.graphs.padded_size(group_tokens)

    def size_expert_step(self, group_tokens: int | None, capacity: int | None) -> None:
        """What this forward's MoE layers agree on with the other expert-parallel ranks (graphs set their own); and
        EPLB's step boundary, which every rank of the group passes once a forward (a step's or an empty MoE pass)."""
        step = self.model.expert_step
        if step is not None:
            step.tokens, step.capacity = group_tokens, capacity
        if self.model.expert_balancer is not None:
            self.model.expert_balancer.step()

    @torch.inference_mode()
    def empty_moe_pass(self, group_tokens: int | None) -> None:
        """A data-parallel rank with no forward this step joins every MoE layer with no tokens, its buffers of the
        group's padded size where the others' are (:mod:`.group.data_parallel`)."""
        self.size_expert_step(group_tokens, self.padded_size(group_tokens))
        empty_moe_pass(self.model)

    def multimodal_step(self, plan: StepPlan, image_embeddings: torch.Tensor | None) -> MultimodalStep | None:
        if not plan.multimodal:
            return None
        dev = self.buffers.dev
        return MultimodalStep(dev["image_rows"][: plan.num_images] if plan.num_images else None, image_embeddings,
                              dev["mrope_positions"][:, : plan.num_tokens] if plan.mrope else None)

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 image_embeddings: torch.Tensor | None = None,
                 previous_tokens: torch.Tensor | None = None,
                 previous_shifts: torch.Tensor | None = None, group_tokens: int | None = None) -> StepResult:
        """Run one step whose values are in the host buffers: float32 logits of the sampling and score rows,
        and the expert routing when the plan records it.

        ``image_embeddings``: one row per image row (vision-language models). ``previous_tokens``: the
        sampled tokens of the step in flight, which the plan's gather rows take as their input.
        ``previous_shifts``: when that step verifies drafts, its drafts rejected per request (on the device),
        which correct the rows of a ``shifted`` plan (:meth:`correct`). ``group_tokens``: with data-parallel
        attention, the largest step of the group's ranks (:func:`.group.data_parallel.agree_tokens`): the step pads to
        the graph size that holds it (:meth:`padded_size`), replayed or eager, as every rank's does.
        """
        dev = self.buffers.dev
        padded = self.padded_size(group_tokens)
        graphs = None if group_tokens is not None and padded is None else self._graphs_for(plan, padded)
        self.size_expert_step(group_tokens, padded)
        if graphs is not None:
            graphs.prepare(plan, padded)
        else:
            self.buffers.upload(plan)
        row_shift = self.correct(plan, previous_shifts) if plan.shifted else None
        if plan.num_gather:
            rows = dev["gather_rows"][: plan.num_gather]
            source = dev["gather_from"][: plan.num_gather]
            if row_shift is not None:  # the bonus token sits after the accepted drafts, not after all of them
                source = source - row_shift[rows]
            dev["token_ids"].index_copy_(0, rows, previous_tokens[source])
        if self.lora_rows is not None:  # a replayed graph reads the slots from the buffer (engine.lora_graphs)
            self.lora_rows.set(dev["lora_rows"][: plan.num_tokens] if plan.lora and graphs is None else None,
                               self.buffers.np["lora_rows"][: plan.num_tokens])
        context = ForwardContext(attention_metadata(self.buffers, plan), kv_caches,
                                 self.multimodal_step(plan, image_embeddings), [] if plan.record_routing else None)
        if isinstance(graphs, DecodeGraphs):
            hidden, routing = graphs.run(plan)
        elif isinstance(graphs, MixedGraphs):
            hidden, routing = graphs.run(plan, context)
        elif self.model.tp.stage.size > 1:  # eager, in micro-batches across the stages
            hidden = self.model.pipelined(dev["token_ids"][: plan.num_tokens], dev["positions"][: plan.num_tokens],
                                          micro_batches(self.buffers, plan, context, self.model.tp.stage.micro_batches))
            routing = None  # (stages serve dense models only)
        else:
            hidden = self.model(dev["token_ids"][: plan.num_tokens], dev["positions"][: plan.num_tokens], context)
            routing = stack_routing(context.routing, self.model.config) if plan.record_routing else None
        rows = plan.num_sample + plan.num_score + plan.num_verify
        if not rows:  # only partial prefill chunks this step: nothing to sample
            return StepResult(hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32), routing)
        lm_rows = dev["lm_rows"][:rows]
        return StepResult(self.model.compute_logits(hidden[lm_rows]), routing,
                          None if row_shift is None else row_shift[lm_rows])

    def correct(self, plan: StepPlan, shifts: torch.Tensor) -> torch.Tensor:
        """Move back, on the device, the rows of each request planned as if the verify step in flight accepted
        all its drafts, by the drafts it rejected (``shifts[shift_from]``): positions, sequence lengths, and cache
        slots looked up again in the block table. The host planned without reading that step, so on a GPU this
        step's planning overlapped its forward. Returns each row's shift (0 for the rows of other requests)."""
        dev, size = self.buffers.dev, self.block_size
        tokens, requests = plan.num_tokens, plan.num_requests
        source = dev["shift_from"][:requests]
        shift = torch.where(source >= 0, shifts[source.clamp(min=0)], 0)
        starts = dev["query_start"][: plan.num_prefill + 1].to(torch.int64)
        decode = torch.ones(plan.num_decode, dtype=torch.int64, device=shift.device)
        counts = torch.cat([decode, starts[1:] - starts[:-1]])  # each request's rows
        owner = torch.repeat_interleave(torch.arange(requests, device=shift.device), counts, output_size=tokens)
        row_shift = shift[owner]
        positions = dev["positions"][:tokens]
        positions.sub_(row_shift)
        dev["seq_lens"][:requests].sub_(shift.to(torch.int32))
        blocks = dev["block_tables"][:requests][owner, positions // size].to(torch.int64)
        slots = dev["slots"][:tokens]
        slots.copy_(torch.where(row_shift != 0, blocks * size + positions % size, slots))
        return row_shift

    def compile_kernels(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Compile every kernel variant a step can meet (see ``warmup``), eagerly and on this rank alone
        (every rank runs the same sweep); returns the seconds it took. Only a GPU compiles: off CUDA the
        kernels are the reference ops or the Triton interpreter (where the sweep took 92 s for nothing)."""
        if self.device.type != "cuda":
            return 0.0
        return compile_kernels(lambda plan, caches: ModelRunner.run_plan(self, plan, caches), self.buffers, kv_caches,
                               self.block_size)

    def capture_graphs(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Capture the graphs over a newly allocated KV pool (engine start, resume).

        A failed capture costs speed, not service: a single rank goes on without graphs. Tensor-parallel
        ranks must capture in lockstep (their warm-up runs all-reduce), and data-parallel attention ranks must pad
        alike, so there it is an error.
        """
        if self.model.expert_balancer is not None:  # the warm-up's tokens served nobody
            self.model.expert_balancer.reset()
        if self.graphs is None:
            return
        if self.lora_rows is not None:  # the base graphs are captured without adapter rows, whatever ran last
            self.lora_rows.batch = None
        try:
            self.graphs.capture(kv_caches)
        except Exception as exc:  # noqa: BLE001 - any capture failure has the same remedy
            self.graphs.release()
            if self.model.tp.size > 1 or self.model.tp.expert_size > 1:  # (data-parallel ranks pad alike)
                raise RuntimeError(f"capturing CUDA graphs failed ({exc}); start the engine with --enforce-eager") from exc
            logger.warning("capturing CUDA graphs failed, running every step eagerly from now on: %s", exc)
            self.graphs = None

    def on_suspend(self, level: int, keep: "ParkOrder | None" = None) -> None:
        """Release the graphs before the pool they point into is freed (``keep``: the blocks every rank parks in
        host memory first, for runners that drive other ranks)."""
        if self.graphs is not None:
            self.graphs.release()

    # Hooks for runners that drive other ranks; a single-rank runner has nothing to tell anyone.

    def on_resume(self, restore: bool = False) -> None:
        """``restore``: the other ranks copy the KV they parked back into their pools (else they drop it)."""

    def group_turn(self, busy: bool, holding: bool = False) -> Turn:
        """Whether the step loop steps now (when this engine has work) and acts on a verb it holds (at once),
        unless data-parallel attention ranks agree on both together (:mod:`.group.data_parallel`)."""
        return Turn(busy, holding)

    def scale_expert_group(self, size: int) -> dict[str, Any]:
        """SCALE_EP's part of this rank: only an expert-parallel group of data-parallel attention ranks that serves
        on without a rank changes its size (:mod:`.group.survival`)."""
        return {"error": f"scale-ep {size}: this engine is not a rank of an expert-parallel group of data-parallel "
                         "attention ranks that can change its size (one process per rank on CPU, --tensor-parallel "
                         "1, --data-parallel-size 3 or more, EPLB off)"}

    def end_step(self) -> None:
        """Called after each step; a data-parallel attention rank that ran no forward in it joins the MoE layers'
        collectives with an empty batch there (:mod:`.group.data_parallel`)."""

    def on_refit(self, source: "WeightSource") -> None:
        pass

    def refit_outcomes(self) -> list[tuple[list[str], str | None]]:
        """Each other rank's part of the refit just run: the names it loaded, and its error if any."""
        return []

    def on_share(self, payload: tuple[str, str, int, float]) -> None:
        """A joiner pulls this engine's weights: every other rank sends its own (:mod:`..weights.peer_pull`)."""

    def share_outcomes(self) -> list[str | None]:
        """Each other rank's part of the pull just run: its error, or None."""
        return []

    def shutdown(self) -> None:
        pass
