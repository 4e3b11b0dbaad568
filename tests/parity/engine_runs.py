"""Running a case through the engine's public API under one setup, and collecting the finished requests.

A :class:`Setup` is the case's own ``InferenceConfig`` fields with some replaced, plus what is not a
config field: the KV pool's size, other traffic in the engine, the kernel backend. The engine is
``DynamicInferenceEngine`` built from its public constructor over weights loaded once per model
(``from_model_dir`` where a setup needs its own load: tensor-parallel ranks, another kernel backend),
driven by ``add_request`` and ``step`` only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from megatron_serve import DynamicInferenceRequest, InferenceConfig
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.engine.precompile.graphs import capture_sizes, graph_batch_sizes
from megatron_serve.engine.kv.cache import blocks_for_tokens
from megatron_serve.multimodal import PromptImage

from ..devices import tensor_parallel_device
from ..graph_replay import install_graphs
from ..parallel.data_parallel_runs import Request
from ..triton_interpreter import install as install_interpreter_patches
from .cases import Case, RequestDraw, context_of
from .data_parallel import run_data_parallel
from .models import LoadedModel

ALTERNATIVE = "<the case's second draw>"  # a Setup.config value: the case's alternative value of that field
SELF = "<the case's own model>"  # a speculative config's ``model``: the target drafts for itself
ADAPTER = "parity-adapter"  # the served name of the model's LoRA adapter in the LoRA rows


@dataclass(frozen=True)
class Setup:
    """How to run a case: config fields over the case's, the KV pool, other traffic, the kernel backend."""

    config: Mapping[str, Any] = field(default_factory=dict)
    kv_pool: str | None = None  # "roomy" or "tiny" (None: the case's draw)
    busy: bool = False  # the case's requests share the engine with other traffic
    kernels: str | None = None  # MEGATRON_KERNELS for this engine's model: "triton", "cpu" or "reference"
    adapter: str | None = None  # LoRA: "others" (the busy traffic uses the model's adapter) or "all" (every request)

    def config_for(self, case: Case) -> dict[str, Any]:
        replaced = {k: case.alternative[k] if v == ALTERNATIVE else v for k, v in self.config.items()}
        return {**case.config, **replaced}

    def config_with_model(self, case: Case, model: "LoadedModel") -> dict[str, Any]:
        """:meth:`config_for`, with a draft model named :data:`SELF` resolved to the case's model directory."""
        fields = self.config_for(case)
        speculative = fields.get("speculative")
        if isinstance(speculative, Mapping) and speculative.get("model") == SELF:
            fields["speculative"] = {**speculative, "model": str(model.directory)}
        if self.adapter is not None:
            fields.update(enable_lora=True, max_loras=1, max_lora_rank=4,
                          lora_modules={ADAPTER: str(model.adapter)})
        return fields


@dataclass(frozen=True)
class Placement:
    """The device and dtype a case's engine (and its reference) computes in."""

    device: str
    dtype: torch.dtype

    def for_config(self, config: Mapping[str, Any]) -> "Placement":
        """Tensor-parallel ranks and stages each need a GPU: without enough of them such a case runs on CPU in
        float32."""
        size = (config.get("tensor_parallel_size", 1) * config.get("pipeline_parallel_size", 1)
                * config.get("data_parallel_size", 1))
        if size > 1 and tensor_parallel_device(size) != torch.device(self.device).type:
            return Placement("cpu", torch.float32)
        return self


@dataclass
class Prepared:
    """A request as the engine receives it: its prompt with each image's placeholders expanded."""

    draw: RequestDraw
    tokens: list[int]
    images: list[PromptImage]


def prepare(model: LoadedModel, draws: tuple[RequestDraw, ...]) -> list[Prepared]:
    prepared = []
    for draw in draws:
        tokens, images = list(draw.prompt), []
        if draw.images:
            tokens, images = model.tokenizer.images.expand(tokens, list(draw.images))
        prepared.append(Prepared(draw, tokens, images))
    return prepared


def kv_blocks(pool: str, prepared: list[Prepared], block: int, max_sequence_length: int) -> int:
    """Blocks for every request at once ("roomy"), or for the largest alone plus one ("tiny": preemption)."""
    sizes = [blocks_for_tokens(min(len(p.tokens) + p.draw.params.num_tokens_to_generate, max_sequence_length),
                               block) for p in prepared]
    return sum(sizes) + 2 if pool == "roomy" else max(sizes) + 1


@contextlib.contextmanager
def _kernels(backend: str | None) -> Iterator[None]:
    """``MEGATRON_KERNELS`` while a model is built (ops are resolved once per model, at construction)."""
    if backend is None:
        yield
        return
    if backend == "triton":  # on CPU its kernels run in the interpreter: without its waste per op
        install_interpreter_patches()
    before = os.environ.get("MEGATRON_KERNELS")
    os.environ["MEGATRON_KERNELS"] = backend
    try:
        yield
    finally:
        if before is None:
            del os.environ["MEGATRON_KERNELS"]
        else:
            os.environ["MEGATRON_KERNELS"] = before


def build_engine(model: LoadedModel, config: InferenceConfig, kernels: str | None) -> DynamicInferenceEngine:
    # an engine with adapters hooks its model's projections: never on the weights other cases share
    if config.world_size > 1 or kernels is not None or config.enable_lora:
        with _kernels(kernels):
            engine = DynamicInferenceEngine.from_model_dir(model.directory, config)
    else:
        weights = model.weights(str(config.device), config.dtype)
        engine = DynamicInferenceEngine(weights.model, weights.tokenizer, config)
    if config.enable_cuda_graphs and engine.device.type == "cpu" and config.world_size == 1:
        # the CPU stand-in for CUDA graphs, decode whole and mixed steps piecewise (one rank: its capture
        # would run no follower)
        sizes = capture_sizes(config.cuda_graph_sizes, config.max_requests)
        install_graphs(engine, graph_batch_sizes(sizes, config.max_requests),
                       mixed_sizes=[size for size in sizes if size <= config.max_batch_tokens])
    return engine


def run_case(case: Case, model: LoadedModel, setup: Setup, placement: Placement,
             counters: dict[str, int] | None = None) -> dict[str, DynamicInferenceRequest]:
    """Every request of the case (and its other traffic, when busy), finished; by request name. ``counters``
    receives the engine's counters at the end (the evidence that a row's path ran: drafts accepted, ...)."""
    fields = setup.config_with_model(case, model)
    placement = placement.for_config(fields)
    prepared = prepare(model, case.requests + (case.fillers if setup.busy else ()))
    max_sequence_length = fields.get("max_sequence_length") or context_of(model)
    fields["num_kv_blocks"] = kv_blocks(setup.kv_pool or case.kv_pool, prepared, fields["block_size_tokens"],
                                        max_sequence_length)
    config = InferenceConfig(dtype=placement.dtype, device=placement.device, **fields)
    if config.data_parallel_size > 1:  # an engine process per data-parallel rank
        with _kernels(setup.kernels):
            return run_data_parallel(model.directory, config, [
                Request(p.draw.name, tuple(p.tokens), p.draw.params, p.draw.arrival) for p in prepared])
    engine = build_engine(model, config, setup.kernels)
    if setup.adapter is not None:
        fillers = {draw.name for draw in case.fillers}
        prepared = [_with_adapter(p) if setup.adapter == "all" or p.draw.name in fillers else p for p in prepared]
    try:
        results = drive(engine, prepared)
        if counters is not None:
            counters.update(engine.stats.counters)
        return results
    finally:
        engine.shutdown()


def _with_adapter(prepared: Prepared) -> Prepared:
    params = msgspec.structs.replace(prepared.draw.params, lora_name=ADAPTER)
    return Prepared(dataclasses.replace(prepared.draw, params=params), prepared.tokens, prepared.images)


def drive(engine: DynamicInferenceEngine, prepared: list[Prepared]) -> dict[str, DynamicInferenceRequest]:
    """Add each request before its arrival step, step until every one finished."""
    requests = {p.draw.name: DynamicInferenceRequest(p.draw.name, None, p.tokens, p.draw.params, images=p.images)
                for p in prepared}
    arrivals = sorted(prepared, key=lambda p: p.draw.arrival)
    limit = 100 + 4 * sum(len(p.tokens) + p.draw.params.num_tokens_to_generate for p in prepared)
    step = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0].draw.arrival <= step:
            engine.add_request(requests[arrivals.pop(0).draw.name])
        engine.step()
        step += 1
        if step > limit:
            stuck = [name for name, r in requests.items() if not r.finished]
            raise AssertionError(f"the engine made no progress in {limit} steps: {stuck} never finished")
    return requests
