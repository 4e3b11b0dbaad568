"""A CPU stand-in for CUDA-graph capture, and a way to give an engine decode graphs built on it."""

from __future__ import annotations

from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.engine.precompile.graphs import DecodeGraphs, MixedGraphs, StepGraphs
from megatron_serve.engine.runner import ModelRunner


class ReplayByRerun:
    """Stands in for ``CudaGraphCapture``: a replay reruns the forward on the static buffers it closed over.

    Everything but the CUDA graph itself is exercised: a step reaches the model only through the
    buffers, so a stale block table or a padding row that wrote a cache slot changes the tokens.
    """

    def __init__(self):
        self.captured_sizes: list[int] = []
        self.replayed_sizes: list[int] = []

    def __call__(self, forward):
        logits, _ = forward()
        self.captured_sizes.append(logits.shape[0])

        def replay():
            outputs = forward()
            self.replayed_sizes.append(outputs[0].shape[0])
            return outputs

        return replay


def install_graphs(engine: DynamicInferenceEngine, batch_sizes: list[int],
                   mixed_sizes: list[int] | None = None) -> ReplayByRerun:
    """Give ``engine`` a runner with decode graphs (and mixed graphs of ``mixed_sizes`` tokens, when given)
    over the stand-in capture, captured now."""
    capture = ReplayByRerun()
    buffers = engine.worker.runner.buffers
    decode = DecodeGraphs(engine.model, batch_sizes, buffers, lambda: capture)
    mixed = MixedGraphs(engine.model, mixed_sizes, buffers) if mixed_sizes else None
    graphs = StepGraphs(decode, mixed, lambda: capture, engine.device)
    # the worker's: suspend releases, and resume captures, the graphs of the runner in use through it
    engine.worker.runner = ModelRunner(engine.model, engine.config.block_size_tokens, engine.device, buffers, graphs)
    engine.worker.runner.capture_graphs(engine.kv_cache.layer_caches)
    return capture
