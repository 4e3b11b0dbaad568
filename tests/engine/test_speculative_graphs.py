"""Verify steps of speculative decoding replay the mixed (piecewise) CUDA graphs: a verify step is shaped like a
small prefill (each request's last token and its guesses), so the decode graphs do not cover it but the mixed
graphs do. On CPU the graphs are the stand-in capture of ``tests/graph_replay.py`` over the same static buffers;
greedy tokens must equal no speculation's, eager."""

from __future__ import annotations

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.config import SpeculativeConfig
from megatron_serve.engine import DynamicInferenceEngine

from ..graph_replay import install_graphs
from ..prompts import PROMPTS, run_to_end

K = 3
MIXED_SIZES = [8, 16, 32]


def _run(model: str, speculative: SpeculativeConfig | None, graphs: bool):
    engine = DynamicInferenceEngine.from_model_dir(model, InferenceConfig(
        dtype="float32", block_size_tokens=16, max_batch_tokens=64, speculative=speculative))
    capture = install_graphs(engine, [1, 2, 4], mixed_sizes=MIXED_SIZES) if graphs else None
    requests = [DynamicInferenceRequest(f"r{i}", None, engine.tokenizer.encode(prompt), SamplingParams(
        temperature=0.0, num_tokens_to_generate=12, ignore_eos=True)) for i, prompt in enumerate(PROMPTS[:4])]
    run_to_end(engine, requests)
    accepted = engine.stats.counters["spec_decode_num_accepted_tokens"]
    engine.shutdown()
    return [r.generated_tokens for r in requests], capture, accepted


def test_verify_steps_replay_the_mixed_graphs_with_the_tokens_of_no_speculation(tiny_llama):
    plain, _, _ = _run(tiny_llama, None, graphs=False)
    drafting = SpeculativeConfig(method="draft_model", model=tiny_llama, num_speculative_tokens=K, adaptive=False)
    tokens, capture, accepted = _run(tiny_llama, drafting, graphs=True)
    assert tokens == plain
    assert accepted > 0, "no guess was accepted: no verify step ran"
    pieces = 3  # the tiny Llama's 2 layers + 1
    # the draft is the target: every guess is accepted, 12 tokens are 3 verify steps of K + 1 rows per request
    verify = [size for size in capture.replayed_sizes if size in MIXED_SIZES]
    assert len(verify) == 3 * pieces, f"verify steps did not replay the mixed graphs: {capture.replayed_sizes}"
