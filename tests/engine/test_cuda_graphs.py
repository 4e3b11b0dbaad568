"""Decode-step graphs: static buffers, padded batch sizes, release on suspend and capture on resume.

On CPU a stand-in capture (``tests.graph_replay``) "replays" by running the captured forward again
over the same static buffers. On a GPU the last test runs the engine's real CUDA graphs against the
eager path.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.engine.precompile.graphs import DecodeGraphs, StepGraphs, capture_sizes, graph_batch_sizes
from megatron_serve.engine.runner import ModelRunner
from megatron_serve.engine.step_plan import StepBuffers, StepPlan
from megatron_serve.model.tiny import make_tiny_model

from ..graph_replay import install_graphs
from ..prompts import PROMPTS, run_steps, run_to_end

BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=20, ignore_eos=True, return_log_probs=True)
# Different lengths finish at different steps, so decode batches shrink through every padded size. The
# first request (owner of cache block 0, where a padding row that wrote slot 0 would land) runs longest.
STAGGERED = [SamplingParams(temperature=0.0, num_tokens_to_generate=6 + 3 * (len(PROMPTS) - i), ignore_eos=True)
             for i in range(len(PROMPTS))]


def config(**overrides) -> InferenceConfig:
    return InferenceConfig(**{"block_size_tokens": BLOCK, "max_requests": 8, **overrides})


_ids = itertools.count()


def make_requests(llm: MegatronLLM, prompts: list[str], params: list[SamplingParams]) -> list[DynamicInferenceRequest]:
    return [DynamicInferenceRequest(f"r{next(_ids)}", p, llm.tokenizer.encode(p), sp) for p, sp in zip(prompts, params)]


def generate_each(llm: MegatronLLM, prompts: list[str], params: list[SamplingParams]):
    """Submit every prompt with its own parameters, step until all finish; requests in input order."""
    requests = make_requests(llm, prompts, params)
    return run_to_end(llm.engine, requests)


@pytest.fixture(scope="module")
def eager_outputs(tiny_llama):
    llm = MegatronLLM(tiny_llama, config())
    greedy = llm.generate(PROMPTS, GREEDY)
    staggered = generate_each(llm, PROMPTS, STAGGERED)
    return ([o.generated_tokens for o in greedy], [o.generated_log_probs for o in greedy],
            [o.generated_tokens for o in staggered])


def test_capture_sizes_follow_vllms_cuda_graph_sizes():
    assert capture_sizes(None, 64) == [1, 2, 4] + list(range(8, 129, 8))  # up to min(2 * max_num_seqs, 512)
    assert capture_sizes(None, 4096)[-1] == 512
    assert capture_sizes([20], 64) == [1, 2, 4, 8, 16]
    assert capture_sizes([3, 1, 3, 40], 64) == [1, 3, 40]  # several values: exactly those


def test_batch_sizes_cover_every_decode_batch_up_to_max_requests():
    assert graph_batch_sizes([1, 2, 4, 8], 1) == [1]
    assert graph_batch_sizes([1, 2, 4, 8], 6) == [1, 2, 4, 6]
    assert graph_batch_sizes(capture_sizes(None, 64), 64)[-1] == 64
    assert graph_batch_sizes(capture_sizes(None, 100), 100) == [1, 2, 4] + list(range(8, 97, 8)) + [100]
    assert graph_batch_sizes(capture_sizes(None, 4096), 4096)[-1] == 512


def test_replayed_decode_steps_equal_eager_steps(tiny_llama, eager_outputs):
    tokens, log_probs, staggered = eager_outputs
    llm = MegatronLLM(tiny_llama, config())
    capture = install_graphs(llm.engine, [1, 2, 4, 8])
    assert capture.captured_sizes == [8, 4, 2, 1]  # largest first: smaller graphs reuse its memory pool

    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.generated_tokens for o in outs] == tokens
    for got, want in zip((o.generated_log_probs for o in outs), log_probs):
        assert got == pytest.approx(want, abs=1e-5)
    assert capture.replayed_sizes.count(8) >= GREEDY.num_tokens_to_generate - 2  # decode ran from the graphs

    capture.replayed_sizes.clear()
    outs = generate_each(llm, PROMPTS, STAGGERED)
    assert [o.generated_tokens for o in outs] == staggered
    # 8 requests that finish one by one: decode batches of 7, 6, 5, 3 run padded to 8 and 4.
    assert {8, 4, 2, 1} <= set(capture.replayed_sizes)


def test_prefill_and_batches_over_the_largest_graph_run_eagerly(tiny_llama, eager_outputs):
    tokens, _, _ = eager_outputs
    llm = MegatronLLM(tiny_llama, config())
    capture = install_graphs(llm.engine, [1, 2])  # 8 running requests never fit
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.generated_tokens for o in outs] == tokens
    assert capture.replayed_sizes == []

    alone = llm.generate(PROMPTS[:2], GREEDY)  # one prefill step, then decode batches of 2
    assert [o.generated_tokens for o in alone] == tokens[:2]
    assert capture.replayed_sizes == [2] * (GREEDY.num_tokens_to_generate - 1)


def test_single_token_prefill_chunks_that_do_not_sample_replay_correctly(tiny_llama, eager_outputs):
    # A 2-token budget: once one request decodes, the other's prefill goes in 1-token chunks, which are
    # decode-shaped and share the step with the decode row; only a prompt's last chunk samples.
    tokens, _, _ = eager_outputs
    llm = MegatronLLM(tiny_llama, config(max_batch_tokens=2, max_requests=2))
    capture = install_graphs(llm.engine, [1, 2])
    outs = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.generated_tokens for o in outs] == tokens[:2]
    assert len(capture.replayed_sizes) >= len(outs[1].prompt_tokens) - 2  # prefill went through the graphs too


def test_suspend_releases_graphs_and_resume_captures_them_over_the_new_pool(tiny_llama, eager_outputs):
    tokens, _, _ = eager_outputs
    llm = MegatronLLM(tiny_llama, config())
    capture = install_graphs(llm.engine, [1, 2, 4, 8])
    graphs = llm.engine.worker.runner.graphs.decode
    engine = llm.engine

    requests = generate_each_partially(llm, steps=6)
    engine.memory.suspend()
    assert not graphs.captured  # nothing holds the freed pool any more
    engine.memory.resume()
    assert graphs.captured and capture.captured_sizes == [8, 4, 2, 1] * 2
    replays_before = len(capture.replayed_sizes)
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.generated_tokens for r in requests] == tokens  # recomputed after the pool was dropped
    assert len(capture.replayed_sizes) > replays_before


def generate_each_partially(llm: MegatronLLM, steps: int):
    requests = make_requests(llm, PROMPTS, [GREEDY] * len(PROMPTS))
    run_steps(llm.engine, requests, steps)
    assert all(r.generated_tokens and not r.finished for r in requests)
    return requests


def test_graphs_survive_refit_and_serve_the_new_weights(tiny_llama, tmp_path):
    from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415

    other = make_tiny_model(tmp_path / "other", seed=1, arch="llama")
    want = [o.generated_tokens for o in MegatronLLM(str(other), config()).generate(PROMPTS, GREEDY)]
    llm = MegatronLLM(tiny_llama, config())
    capture = install_graphs(llm.engine, [1, 2, 4, 8])
    llm.engine.memory.refit(other)
    assert llm.engine.worker.runner.graphs.decode.captured  # weights were copied in place: same addresses
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.generated_tokens for o in outs] == want
    assert capture.replayed_sizes


def three_decode_rows(buffers: StepBuffers) -> StepPlan:
    """Three decode-shaped rows over blocks 5, 6 and 7; the middle one is a prefill chunk that does not sample."""
    out = buffers.np
    out["token_ids"][:3], out["positions"][:3] = [11, 12, 13], [2, 3, 4]
    out["slots"][:3] = [5 * BLOCK + 2, 6 * BLOCK + 3, 7 * BLOCK + 4]
    out["block_tables"][:3, 0], out["seq_lens"][:3], out["lm_rows"][:2] = [5, 6, 7], [3, 4, 5], [0, 2]
    return StepPlan(num_tokens=3, num_decode=3, num_prefill=0, block_width=1, num_sample=2, num_score=0)


def test_a_replay_pads_rows_to_write_nothing_and_returns_only_sampling_rows(tiny_llama):
    llm = MegatronLLM(tiny_llama, config())
    capture = install_graphs(llm.engine, [4])
    engine, graphs = llm.engine, llm.engine.worker.runner.graphs.decode
    buffers = engine.worker.runner.buffers
    for layer_k, layer_v in engine.kv_cache.layer_caches:
        torch.manual_seed(0)
        layer_k.normal_()
        layer_v.normal_()
    untouched = [k.clone() for k, _ in engine.kv_cache.layer_caches]

    plan = three_decode_rows(buffers)
    eager = ModelRunner(engine.model, BLOCK, engine.device, buffers).run_plan(plan, engine.kv_cache.layer_caches)
    assert graphs.covers(plan)
    capture.replayed_sizes.clear()
    replayed = engine.worker.runner.run_plan(plan, engine.kv_cache.layer_caches)
    assert capture.replayed_sizes == [4] and replayed.routing is None  # one padded replay; a dense model

    assert replayed.logits.shape == eager.logits.shape == (2, engine.model.config.vocab_size)
    torch.testing.assert_close(replayed.logits, eager.logits)
    assert buffers.dev["slots"][3].item() == -1 and buffers.dev["seq_lens"][3].item() == 0  # the padding row
    for before, (after, _) in zip(untouched, engine.kv_cache.layer_caches):
        changed = (before != after).flatten(2).any(-1).nonzero().tolist()
        assert changed == [[5, 2], [6, 3], [7, 4]]  # [block, offset] of the three real rows, nothing else


def test_moe_decode_graphs_return_the_routing_of_their_rows(tmp_path):
    """MoE graphs output the step's expert ids too; a replayed decode step records the same rows as eager."""
    model_dir = str(make_tiny_model(tmp_path / "moe", seed=3, arch="mixtral"))
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True, return_routing_indices=True)
    eager = MegatronLLM(model_dir, config()).generate(PROMPTS[:3], params)
    llm = MegatronLLM(model_dir, config())
    capture = install_graphs(llm.engine, [1, 2, 4])
    replayed = llm.generate(PROMPTS[:3], params)
    assert capture.replayed_sizes.count(4) >= params.num_tokens_to_generate - 2  # 3 rows padded to 4
    for ours, theirs in zip(replayed, eager):
        assert ours.generated_tokens == theirs.generated_tokens
        assert ours.routing_indices.tolist() == theirs.routing_indices.tolist()


def test_a_failed_capture_leaves_a_working_eager_engine(tiny_llama, eager_outputs, caplog):
    tokens, _, _ = eager_outputs
    llm = MegatronLLM(tiny_llama, config())
    engine = llm.engine

    def broken_capture(forward):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = DecodeGraphs(engine.model, [1, 2, 4, 8], engine.worker.runner.buffers, lambda: broken_capture)
    engine.worker.runner = ModelRunner(engine.model, BLOCK, engine.device, engine.worker.runner.buffers,
                                       StepGraphs(graphs, None, lambda: broken_capture, engine.device))
    engine.worker.runner.capture_graphs(engine.kv_cache.layer_caches)
    assert engine.worker.runner.graphs is None
    assert "capturing CUDA graphs failed" in caplog.text
    assert [o.generated_tokens for o in llm.generate(PROMPTS, GREEDY)] == tokens
    engine.memory.suspend()
    engine.memory.resume()  # no graphs to capture again: still serves
    assert [o.generated_tokens for o in llm.generate(PROMPTS, GREEDY)] == tokens


def test_graphs_cover_decode_only_plans_up_to_the_largest_size(tiny_llama):
    llm = MegatronLLM(tiny_llama, config())
    install_graphs(llm.engine, [1, 2])
    graphs = llm.engine.worker.runner.graphs.decode
    assert graphs.covers(StepPlan(2, 2, 0, 1, 2, 0))
    assert not graphs.covers(StepPlan(3, 3, 0, 1, 3, 0))  # over the largest graph
    assert not graphs.covers(StepPlan(5, 1, 1, 1, 2, 0))  # a prefill chunk


def test_cuda_graphs_flag_round_trips_through_engine_argv():
    import argparse  # noqa: PLC0415

    from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args  # noqa: PLC0415
    from megatron_serve.fleet.argv import inference_config_to_argv  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    for value in (True, False):
        original = InferenceConfig(device="cpu", enable_cuda_graphs=value, enable_prefix_caching=not value,
                                   max_requests=5, block_size_tokens=4, dtype="float32", async_scheduling=value,
                                   cuda_graph_sizes=[1, 8, 24] if value else None)
        rebuilt = inference_config_from_args(parser.parse_args(inference_config_to_argv(original)))
        assert rebuilt.to_dict() == original.to_dict()
    with pytest.raises(ValueError, match="enable_cuda_graphs must be true or false"):
        InferenceConfig(enable_cuda_graphs="yes")
    with pytest.raises(ValueError, match="cuda_graph_sizes must be a non-empty list of positive integers"):
        InferenceConfig(cuda_graph_sizes=[8, 0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_cuda_graphs_equal_the_eager_engine(tiny_llama):
    eager = MegatronLLM(tiny_llama, config(device="cuda", enable_cuda_graphs=False, dtype="float32"))
    graphed = MegatronLLM(tiny_llama, config(device="cuda", dtype="float32"))
    assert graphed.engine.worker.runner.graphs.decode.captured
    want = [o.generated_tokens for o in eager.generate(PROMPTS, GREEDY)]
    assert [o.generated_tokens for o in graphed.generate(PROMPTS, GREEDY)] == want
    assert [o.generated_tokens for o in generate_each(graphed, PROMPTS, STAGGERED)] == \
        [o.generated_tokens for o in generate_each(eager, PROMPTS, STAGGERED)]
    graphed.engine.memory.suspend()
    assert not graphed.engine.worker.runner.graphs.decode.captured
    graphed.engine.memory.resume()
    assert graphed.engine.worker.runner.graphs.decode.captured
    assert [o.generated_tokens for o in graphed.generate(PROMPTS, GREEDY)] == want


EP = dict(enable_expert_parallel=True)


@pytest.mark.parametrize("layout, eager", [
    (dict(data_parallel_size=2, **EP), False),  # DP attention at TP=1: the group pads to one graph size
    (dict(data_parallel_size=2, tensor_parallel_size=2, all2all_backend="alltoall", **EP), False),
    (dict(tensor_parallel_size=2, **EP), False),
    (dict(tensor_parallel_size=2, all2all_backend="deepep_low_latency", device="cuda", **EP), False),
    (dict(tensor_parallel_size=2, all2all_backend="allgather_reducescatter", **EP), True),  # nonzero() on the host
    (dict(tensor_parallel_size=2, all2all_backend="deepep_high_throughput", device="cuda", **EP), True),
    (dict(tensor_parallel_size=2, batch_invariant=True, **EP), True),  # invariant.fused_moe's loop
    (dict(**EP), False),  # one rank: the flag moves no token
    (dict(), False),
])
def test_expert_parallel_steps_are_captured_unless_the_backend_reads_counts_on_the_host(monkeypatch, tmp_path,
                                                                                         layout, eager):
    """On a device that captures (``graphs_wanted`` stands in for CUDA here), an expert-parallel MoE model's graphs
    are captured with the fixed-capacity all-to-all (``auto``/``alltoall``) or DeepEP's low-latency mode, under
    data-parallel attention too; refused where the backend's dispatch reads counts on the host every layer
    (``allgather_reducescatter``, DeepEP's normal mode) and in the batch-invariant mode (its expert loop)."""
    from megatron_serve.engine.precompile import graphs  # noqa: PLC0415
    from megatron_serve.engine.sizing import engine_buffers  # noqa: PLC0415
    from megatron_serve.model.loader import load_model  # noqa: PLC0415

    model = load_model(str(make_tiny_model(tmp_path / "moe", seed=3, arch="mixtral")), torch.float32, "cpu")
    monkeypatch.setattr(graphs, "graphs_wanted", lambda config, device: True)
    engine_config = config(**{"device": "cpu", **layout})
    buffers = engine_buffers(engine_config, 64, torch.device("cpu"))
    assert (graphs.graphs_for(model, engine_config, buffers) is None) == eager
    assert (graphs.eager_reason(engine_config, moe=True) is not None) == eager
