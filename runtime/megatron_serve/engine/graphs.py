"""Decode steps replayed from CUDA graphs: one graph per padded batch size, over static input buffers.

A decode step launches a few hundred small kernels; at small batches those launches, not the GPU,
set the pace. Capturing the whole step (forward pass and LM head) once per batch size and replaying
it removes that cost. A graph reads its inputs from fixed buffers (token ids, positions, cache
slots, block tables, context lengths), so a step only copies its values in and replays. Rows past
the real batch are padding: they write no cache slot (slot -1) and attend to nothing (context 0).

A graph holds the addresses of the KV cache and the weights it was captured with. It is released
when the engine suspends (the pool is freed; weights may leave the GPU) and captured again on resume.
Refit copies weights in place, so graphs survive it.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Callable

import torch

from megatron_kernels.ops import backend_for

from ..config import InferenceConfig
from ..model.moe import stack_routing
from .kv_cache import blocks_for_tokens
from ..model.attention import AttentionMetadata, ForwardContext
from ..model.llama import LlamaForCausalLM

if TYPE_CHECKING:  # model_runner imports this module
    from .runner import StepPlan

MAX_GRAPH_BATCH = 512  # larger decode batches are compute-bound: launch overhead no longer matters
WARMUP_RUNS = 2  # eager runs before capture: compile every Triton variant, settle the allocator

# The outputs of one decode step: logits, and the expert ids of MoE models (routing replay).
GraphOutputs = tuple[torch.Tensor, torch.Tensor | None]
# Turns a zero-argument forward into a replay function that returns the forward's outputs.
GraphCapture = Callable[[Callable[[], GraphOutputs]], Callable[[], GraphOutputs]]


def graph_batch_sizes(max_requests: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_requests`` (itself included, so every decode batch fits)."""
    limit = min(max_requests, MAX_GRAPH_BATCH)
    sizes = {size for size in (1, 2, 4, 8) if size <= limit}
    sizes.update(range(16, limit + 1, 16))
    sizes.add(limit)
    return sorted(sizes)


class CudaGraphCapture:
    """Captures with ``torch.cuda.CUDAGraph``; one capture round shares one memory pool.

    Graphs are captured largest batch first, so the smaller ones fit in the memory the first one
    took from the pool. A new round (after resume) gets a new pool; the old one is freed with its graphs.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, forward: Callable[[], GraphOutputs]) -> Callable[[], GraphOutputs]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of the process's other threads cannot invalidate this capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = forward()

        def replay() -> GraphOutputs:
            graph.replay()
            return output

        return replay


class DecodeGraphs:
    """Static input buffers and one captured decode step per batch size."""

    def __init__(self, model: LlamaForCausalLM, batch_sizes: list[int], max_blocks_per_sequence: int,
                 device: torch.device, capture_factory: Callable[[], GraphCapture]):
        if not batch_sizes:
            raise ValueError("decode graphs need at least one batch size")
        self.model = model
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks_per_sequence = max_blocks_per_sequence
        self._capture_factory = capture_factory
        size = self.max_batch
        self.token_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slots = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((size, max_blocks_per_sequence), dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self._replays: dict[int, Callable[[], GraphOutputs]] = {}

    @property
    def captured(self) -> bool:
        return bool(self._replays)

    def capture(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Capture every batch size over ``kv_caches`` (replacing earlier graphs)."""
        self.release()
        self._reset_to_padding()  # warm-up and capture runs then write no cache slot
        capture = self._capture_factory()
        for size in reversed(self.batch_sizes):
            self._replays[size] = capture(self._forward_for(size, kv_caches))

    def release(self) -> None:
        """Drop the graphs, and with them their references to the KV cache and their memory pool."""
        self._replays.clear()

    def covers(self, plan: StepPlan) -> bool:
        """Whether ``plan`` is a decode-only step that a captured graph can run."""
        return (self.captured and not plan.prefill_block_tables and 0 < len(plan.token_ids) <= self.max_batch
                and len(plan.decode_block_tables[0]) <= self.max_blocks_per_sequence)

    def run(self, plan: StepPlan) -> GraphOutputs:
        """Copy ``plan`` into the static buffers, replay the smallest graph that fits.

        Returns the logits of the sampling rows, and the step's expert ids when the plan records them
        (MoE graphs always compute them: a few bytes per token).
        """
        count = len(plan.token_ids)
        size = self.batch_sizes[bisect.bisect_left(self.batch_sizes, count)]
        padding = size - count
        self._fill(self.token_ids, plan.token_ids + [0] * padding)
        self._fill(self.positions, plan.positions + [0] * padding)
        self._fill(self.slots, plan.slots + [-1] * padding)
        self._fill(self.context_lens, plan.decode_context_lens + [0] * padding)
        width = len(plan.decode_block_tables[0])
        self.block_tables[:count, :width].copy_(torch.tensor(plan.decode_block_tables, dtype=torch.int32),
                                                non_blocking=True)
        logits, routing = self._replays[size]()
        routing = routing[:count] if plan.record_routing and routing is not None else None
        if len(plan.sample_rows) == count:  # every row samples (the usual decode step)
            return logits[:count], routing
        return logits[torch.tensor(plan.sample_rows, dtype=torch.int64, device=logits.device)], routing

    @staticmethod
    def _fill(buffer: torch.Tensor, values: list[int]) -> None:
        buffer[: len(values)].copy_(torch.tensor(values, dtype=buffer.dtype), non_blocking=True)

    def _reset_to_padding(self) -> None:
        self.token_ids.zero_()
        self.positions.zero_()
        self.slots.fill_(-1)
        self.context_lens.zero_()
        self.block_tables.zero_()

    def _forward_for(self, size: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                     ) -> Callable[[], GraphOutputs]:
        metadata = AttentionMetadata(
            slot_mapping=self.slots[:size], num_decode_tokens=size,
            decode_block_tables=self.block_tables[:size], decode_context_lens=self.context_lens[:size],
            prefill_block_tables=None, prefill_query_start_loc=None, prefill_context_lens=None,
        )
        token_ids, positions = self.token_ids[:size], self.positions[:size]
        moe = self.model.config.moe is not None

        @torch.inference_mode()
        def forward() -> GraphOutputs:
            context = ForwardContext(metadata, kv_caches, routing=[] if moe else None)
            logits = self.model.compute_logits(self.model(token_ids, positions, context))
            return logits, stack_routing(context.routing, self.model.config) if moe else None

        return forward


def decode_graphs_for(model: LlamaForCausalLM, config: InferenceConfig, max_sequence_length: int,
                      device: torch.device) -> DecodeGraphs | None:
    """Decode graphs for this engine, or ``None`` where they cannot or should not be used.

    Only on CUDA with the Triton kernels: the reference ops read lengths back to the host
    (``int(context_lens.max())``), which a capture forbids.
    """
    if not config.enable_cuda_graphs or device.type != "cuda" or backend_for(device) != "triton":
        return None
    return DecodeGraphs(model, graph_batch_sizes(config.max_requests),
                        blocks_for_tokens(max_sequence_length, config.block_size_tokens), device,
                        lambda: CudaGraphCapture(device))
