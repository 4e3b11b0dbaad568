"""Decode steps replayed from CUDA graphs: one graph per padded batch size, over static input buffers.

A decode step launches a few hundred small kernels; at small batches those launches, not the GPU,
set the pace. Capturing the whole step (forward pass and LM head) once per batch size and replaying
it removes that cost. A graph reads its inputs from the runner's persistent step buffers (token ids,
positions, cache slots, block tables, context lengths), so a step only writes its values there and replays. Rows past
the real batch are padding: they write no cache slot (slot -1) and attend to nothing (context 0).

A graph holds the addresses of the KV cache and the weights it was captured with. It is released
when the engine suspends (the pool is freed; weights may leave the GPU) and captured again on resume.
Refit copies weights in place, so graphs survive it.

Under expert parallelism a graph's MoE layers use the fixed-capacity all-to-all (or DeepEP's low-latency mode),
sized for the graph's batch (:class:`~megatron_serve.model.experts.dispatch.ExpertStep`, set as the graph is
captured). Every rank captures the same graphs in the same order, so their collectives pair up. With data-parallel
attention the ranks run different batches: before each step they agree on the largest token count
(:func:`.group.data_parallel.agree_tokens`), and every rank pads its step to the same size
(:meth:`StepGraphs.padded_size`): a rank replays its graph of that size, or runs eagerly with buffers of that size
(a step a graph does not cover, or an idle rank's empty MoE pass), so every MoE layer's all-to-alls have one shape on
every rank.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Callable

import torch

from megatron_kernels.ops import backend_for

from ...config import InferenceConfig
from ...model.experts.moe import routing_dtype, stack_routing
from ...model.attention import AttentionMetadata, ForwardContext
from ..step_plan import StepBuffers, StepPlan

if TYPE_CHECKING:  # annotations only: the runner hands graphs the model
    from ...model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512  # larger decode batches are compute-bound: launch overhead no longer matters
WARMUP_RUNS = 2  # eager runs before capture: compile every Triton variant, settle the allocator

# The outputs of a replayed forward: final hidden states, and the expert ids of MoE models (routing replay).
GraphOutputs = tuple[torch.Tensor, torch.Tensor | None]
# Turns a zero-argument forward into a replay function that returns the forward's outputs.
GraphCapture = Callable[[Callable[[], GraphOutputs]], Callable[[], GraphOutputs]]


def capture_sizes(requested: list[int] | None, max_requests: int) -> list[int]:
    """Token counts to capture, with vLLM's meaning of ``--cuda-graph-sizes``: none given, up to
    ``min(2 * max_requests, 512)``; one value N, ``1, 2, 4`` then every 8 up to N; several, exactly those."""
    if requested is not None and len(requested) > 1:
        return sorted(set(requested))
    limit = requested[0] if requested else min(2 * max_requests, MAX_GRAPH_BATCH)
    return sorted({size for size in (1, 2, 4) if size <= limit} | set(range(8, limit + 1, 8)))


def graph_batch_sizes(sizes: list[int], max_requests: int) -> list[int]:
    """The decode graphs' batch sizes: the capture sizes up to ``max_requests``, and ``max_requests`` itself
    (capped at 512), so that every decode batch fits one."""
    limit = min(max_requests, MAX_GRAPH_BATCH)
    return sorted({size for size in sizes if size <= limit} | {limit})


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
    """One captured decode step per batch size, over the runner's persistent step buffers."""

    def __init__(self, model: LlamaForCausalLM, batch_sizes: list[int], buffers: StepBuffers,
                 capture_factory: Callable[[], GraphCapture]):
        if not batch_sizes:
            raise ValueError("decode graphs need at least one batch size")
        self.model = model
        self.batch_sizes = sorted(size for size in batch_sizes if size <= buffers.max_requests)
        self.max_batch = self.batch_sizes[-1]
        self.buffers = buffers
        self._capture_factory = capture_factory
        self.hidden = torch.zeros(self.max_batch, model.config.hidden_size, dtype=model.dtype,
                                  device=buffers.device)
        self._replays: dict[int, Callable[[], GraphOutputs]] = {}
        self._size = 0  # the size the last ``prepare`` chose

    @property
    def captured(self) -> bool:
        return bool(self._replays)

    def capture(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], capture: GraphCapture | None = None) -> None:
        """Capture every batch size over ``kv_caches`` (replacing earlier graphs)."""
        self.release()
        self._reset_to_padding()  # warm-up and capture runs then write no cache slot
        capture = capture or self._capture_factory()
        for size in reversed(self.batch_sizes):
            self._replays[size] = capture(self._forward_for(size, kv_caches))

    def release(self) -> None:
        """Drop the graphs, and with them their references to the KV cache and their memory pool."""
        self._replays.clear()

    def covers(self, plan: StepPlan, size: int | None = None) -> bool:
        """Whether ``plan`` is a decode-only step that a captured graph can run (steps with images embed them
        outside any graph: eager); ``size``: the graph's batch size must be this one (data-parallel attention)."""
        if size is not None and size not in self.batch_sizes:
            return False
        return self.captured and plan.decode_only and 0 < plan.num_tokens <= self.max_batch and not plan.multimodal

    def prepare(self, plan: StepPlan, size: int | None = None) -> None:
        """Pad the plan to ``size``, or the smallest captured size that fits, and copy it to the device buffers."""
        self._size = size or self.batch_sizes[bisect.bisect_left(self.batch_sizes, plan.num_tokens)]
        self.buffers.pad(plan, self._size, self._size)
        self.buffers.upload(plan, self._size, self._size)

    def run(self, plan: StepPlan) -> GraphOutputs:
        """Replay the graph ``prepare`` chose. Returns the final hidden states of the step's rows, and their expert
        ids when the plan records them (MoE graphs always compute them: a few bytes per token)."""
        count = plan.num_tokens
        hidden, routing = self._replays[self._size]()
        return hidden[:count], routing[:count] if plan.record_routing and routing is not None else None

    def _reset_to_padding(self) -> None:
        dev = self.buffers.dev
        dev["token_ids"].zero_()
        dev["positions"].zero_()
        dev["slots"].fill_(-1)
        dev["seq_lens"].zero_()
        dev["block_tables"].zero_()

    def _forward_for(self, size: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                     ) -> Callable[[], GraphOutputs]:
        dev = self.buffers.dev
        metadata = AttentionMetadata(
            slot_mapping=dev["slots"][:size], num_decode_tokens=size,
            decode_block_tables=dev["block_tables"][:size], decode_context_lens=dev["seq_lens"][:size],
            prefill_block_tables=None, prefill_query_start_loc=None, prefill_context_lens=None,
        )
        token_ids, positions = dev["token_ids"][:size], dev["positions"][:size]
        moe = self.model.config.moe is not None

        @torch.inference_mode()
        def forward() -> GraphOutputs:
            size_expert_buffers(self.model, size)
            context = ForwardContext(metadata, kv_caches, routing=[] if moe else None)
            self.hidden[:size].copy_(self.model(token_ids, positions, context))
            return self.hidden[:size], stack_routing(context.routing, self.model.config) if moe else None

        return forward


class MixedGraphs:
    """Steps of any mix up to the largest captured token count, replayed piecewise (see the module docstring).

    Piece 0 embeds the tokens and runs layer 0 up to its cache write; piece ``i`` runs layer ``i - 1``
    from its output projection through the MLP, then layer ``i`` up to its cache write; the last piece
    ends with the final norm. Pieces hand over through persistent buffers (rotated queries, attention
    outputs, the residual stream), so a piece's own temporaries are freed once captured: every piece of
    every size shares the capture round's memory pool.
    """

    def __init__(self, model: LlamaForCausalLM, sizes: list[int], buffers: StepBuffers):
        self.model = model
        self.sizes = sorted(size for size in sizes if size <= buffers.max_tokens)
        if not self.sizes:
            raise ValueError("mixed graphs need at least one token count within the step's token budget")
        self.buffers = buffers
        config, layers = model.config, model.model.layers
        attention = layers[0].self_attn
        rows, dtype, device = self.sizes[-1], model.dtype, buffers.device
        heads = attention.q_size // attention.head_dim
        self.queries = torch.zeros(rows, heads, attention.head_dim, dtype=dtype, device=device)
        self.attended = torch.zeros_like(self.queries)
        self.residual = torch.zeros(rows, config.hidden_size, dtype=dtype, device=device)
        self.hidden = torch.zeros_like(self.residual)
        self._moe_slot = {i: n for n, i in enumerate(i for i, layer in enumerate(layers) if layer.sparse)}
        self.routing = (torch.zeros(rows, len(self._moe_slot), config.moe.top_k, dtype=routing_dtype(config.moe),
                                    device=device) if self._moe_slot else None)
        self._replays: dict[int, list[Callable[[], GraphOutputs]]] = {}
        self._size = 0

    @property
    def captured(self) -> bool:
        return bool(self._replays)

    @property
    def count(self) -> int:
        return sum(len(pieces) for pieces in self._replays.values())

    def capture(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], capture: GraphCapture) -> None:
        """Capture every piece of every size over ``kv_caches`` (replacing earlier graphs), in ``capture``'s
        round (the decode graphs' pool)."""
        self.release()
        for size in reversed(self.sizes):
            self._replays[size] = [capture(piece) for piece in self._pieces_for(size, kv_caches)]

    def release(self) -> None:
        self._replays.clear()

    def covers(self, plan: StepPlan, size: int | None = None) -> bool:
        """Whether ``plan`` fits a captured size (steps with images embed them outside any graph: eager);
        ``size``: that size must be this one (data-parallel attention)."""
        if size is not None and size not in self.sizes:
            return False
        return self.captured and plan.num_tokens <= self.sizes[-1] and not plan.multimodal

    def prepare(self, plan: StepPlan, size: int | None = None) -> None:
        """Pad the plan's rows to ``size``, or the smallest captured size that fits, and copy it to the device
        buffers."""
        self._size = size or self.sizes[bisect.bisect_left(self.sizes, plan.num_tokens)]
        self.buffers.pad(plan, self._size, plan.num_requests)
        self.buffers.upload(plan, self._size, plan.num_requests)

    def run(self, plan: StepPlan, context: ForwardContext) -> GraphOutputs:
        """Replay the pieces ``prepare`` chose, attention in between; returns the final hidden states of the
        step's rows and, when the plan records them, their expert ids."""
        count = plan.num_tokens
        pieces = self._replays[self._size]
        pieces[0]()
        for layer, piece in zip(self.model.model.layers, pieces[1:]):
            layer.self_attn.attn.attend(self.queries[:count], context, out=self.attended[:count])
            piece()
        # A copy: off CUDA the readback holds this very tensor, and the next step rewrites the buffer.
        routing = self.routing[:count].clone() if plan.record_routing and self.routing is not None else None
        return self.hidden[:count], routing

    def _pieces_for(self, size: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                    ) -> list[Callable[[], GraphOutputs]]:
        dev = self.buffers.dev
        metadata = AttentionMetadata(slot_mapping=dev["slots"][:size], num_decode_tokens=0, decode_block_tables=None,
                                     decode_context_lens=None, prefill_block_tables=None,
                                     prefill_query_start_loc=None, prefill_context_lens=None)
        token_ids, positions = dev["token_ids"][:size], dev["positions"][:size]
        model, layers = self.model, self.model.model.layers
        cos, sin = model.rotary_cos, model.rotary_sin
        queries, attended, residual_rows = self.queries[:size], self.attended[:size], self.residual[:size]

        def piece(index: int) -> Callable[[], GraphOutputs]:
            @torch.inference_mode()
            def forward() -> GraphOutputs:
                size_expert_buffers(model, size)
                context = ForwardContext(metadata, kv_caches, routing=[] if index - 1 in self._moe_slot else None)
                if index == 0:
                    hidden, residual = model.model.embed_tokens(token_ids), None
                else:
                    hidden, residual = layers[index - 1].after_attention(attended, residual_rows, context)
                    if context.routing:
                        self.routing[:size, self._moe_slot[index - 1]].copy_(context.routing[0])
                if index == len(layers):
                    self.hidden[:size].copy_(model.model.norm(hidden, residual)[0])
                    return self.hidden[:size], None
                q, residual = layers[index].before_attention(positions, hidden, residual, context, cos, sin)
                queries.copy_(q)
                residual_rows.copy_(residual)
                return queries, None

            return forward

        return [piece(index) for index in range(len(layers) + 1)]


class StepGraphs:
    """An engine's graphs: decode graphs and mixed graphs, captured in one round over one memory pool."""

    def __init__(self, decode: DecodeGraphs, mixed: MixedGraphs | None, capture_factory: Callable[[], GraphCapture],
                 device: torch.device):
        self.decode, self.mixed = decode, mixed
        self.lora_decode: DecodeGraphs | None = None  # decode steps with adapter rows (engine.lora_graphs)
        self._capture_factory = capture_factory
        self.device = device

    @property
    def capture_factory(self) -> Callable[[], GraphCapture]:
        return self._capture_factory

    def capture(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Capture every graph over ``kv_caches``; logs how many, how long it took and the memory they hold."""
        started = time.perf_counter()
        free_before = _free_memory(self.device)
        capture = self._capture_factory()
        self.decode.capture(kv_caches, capture)
        if self.mixed is not None:
            self.mixed.capture(kv_caches, capture)
        if self.lora_decode is not None:
            self.lora_decode.capture(kv_caches, capture)
        used = free_before - _free_memory(self.device)
        logger.info("captured %d CUDA graphs (decode batches %s; mixed steps of up to %s tokens, piecewise) in "
                    "%.1fs, holding %.0f MiB", len(self.decode.batch_sizes) + (self.mixed.count if self.mixed else 0),
                    _span(self.decode.batch_sizes), self.mixed.sizes[-1] if self.mixed else "-",
                    time.perf_counter() - started, used / 2**20)

    def release(self) -> None:
        self.decode.release()
        if self.mixed is not None:
            self.mixed.release()
        if self.lora_decode is not None:
            self.lora_decode.release()

    def padded_size(self, tokens: int) -> int | None:
        """The graph size a data-parallel group's step of ``tokens`` (its ranks' largest) pads to on every rank:
        the smallest decode or mixed size that holds it; None above the largest (the step runs eagerly with exact
        counts). From the configured sizes, captured or not, so that every rank answers alike."""
        sizes = sorted(set(self.decode.batch_sizes) | set(self.mixed.sizes if self.mixed is not None else ()))
        at = bisect.bisect_left(sizes, max(tokens, 1))
        return sizes[at] if at < len(sizes) else None


def size_expert_buffers(model: LlamaForCausalLM, size: int) -> None:
    """A graph's MoE layers move tokens in buffers sized for its batch (as its capture sees them, and a stand-in's
    rerun: the value lives in the graph once captured)."""
    if model.expert_step is not None:
        model.expert_step.capacity, model.expert_step.tokens = size, None


def _free_memory(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def _span(sizes: list[int]) -> str:
    return f"{sizes[0]}-{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])


def graphs_wanted(config: InferenceConfig, device: torch.device) -> bool:
    """Whether an engine on ``device`` captures graphs: CUDA with the Triton kernels (the reference ops read
    lengths back to the host, ``int(context_lens.max())``, which a capture forbids), unless turned off.
    ``--batch-invariant`` included: on CUDA its attention is ``triton_invariant_attention``, which reads the
    step's lengths on the device (the CPU mode's gathers read them on the host, but CPU has no graphs)."""
    return config.enable_cuda_graphs and device.type == "cuda" and backend_for(device) == "triton"


#: The ``--all2all-backend`` values whose MoE layers read counts on the host in every step, and where.
EAGER_BACKENDS = {
    "allgather_reducescatter": "AllGatherDispatcher picks each rank's rows with nonzero()",
    "deepep_high_throughput": "DeepEP's normal mode reads its received counts on the host",
}


def eager_reason(config: InferenceConfig, moe: bool) -> str | None:
    """Why an engine's steps cannot be captured whatever its device (None: they can). ``moe``: the model has
    mixture-of-experts layers. Expert parallelism captures with the fixed-capacity all-to-all (``alltoall``, and
    ``auto`` without DeepEP) or DeepEP's low-latency mode."""
    if config.batch_invariant and moe:
        return "--batch-invariant MoE: invariant.fused_moe's expert loop reads its row counts on the host"
    expert_parallel = moe and config.enable_expert_parallel and config.world_size > 1
    if expert_parallel and config.all2all_backend in EAGER_BACKENDS:
        return f"--all2all-backend {config.all2all_backend}: {EAGER_BACKENDS[config.all2all_backend]}"
    if config.pipeline_parallel_size > 1:
        return "pipeline stages hand hidden states over point-to-point"
    return None


def largest_graph(config: InferenceConfig, device: torch.device) -> int:
    """Rows of the largest step an engine on ``device`` replays from graphs (0: none)."""
    if not graphs_wanted(config, device):
        return 0
    return min(max(capture_sizes(config.cuda_graph_sizes, config.max_requests)), config.max_batch_tokens)


def graphs_for(model: LlamaForCausalLM, config: InferenceConfig, buffers: StepBuffers,
               capture_factory: Callable[[], GraphCapture] | None = None) -> StepGraphs | None:
    """The graphs of this engine, or ``None`` where they are not wanted (``graphs_wanted``), unless
    ``capture_factory`` stands in for the capture (tests run the same buffers and pieces eagerly on CPU).
    """
    device = buffers.device
    if not config.enable_cuda_graphs:
        return None
    if capture_factory is None:
        if eager_reason(config, model.config.moe is not None) is not None or not graphs_wanted(config, device):
            return None
        capture_factory = lambda: CudaGraphCapture(device)  # noqa: E731
    sizes = capture_sizes(config.cuda_graph_sizes, config.max_requests)
    decode = DecodeGraphs(model, graph_batch_sizes(sizes, config.max_requests), buffers, capture_factory)
    mixed = MixedGraphs(model, sizes, buffers) if min(sizes) <= buffers.max_tokens else None
    return StepGraphs(decode, mixed, capture_factory, device)
