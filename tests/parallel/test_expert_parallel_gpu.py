"""Expert parallelism on GPUs (``bash benchmarks/gpu_session.sh ep``; skipped without CUDA): an MoE layer with the
fixed-capacity all-to-all captured in a CUDA graph replays what it computes eagerly, with no host synchronization
(CUDA's sync debug mode raises at one; the exact all-to-all, the control, does raise); over 2 GPUs an engine of
EP=2 replaying its steps from graphs gives the tokens of the same engine run eagerly; and where ``deep_ep`` imports,
its normal and low-latency modes give one rank's MoE layer outputs.

Each probe runs in processes of its own, one per GPU (NCCL); a one-GPU machine runs the one-rank probe, whose
all-to-all is a real NCCL collective over a group of one."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.model.tiny import make_tiny_model

from ..helpers import free_port
from ..prompts import PROMPTS

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count()
pytestmark = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU: CUDA graphs, NCCL and DeepEP run on GPUs only")
SKIPPED = 3  # a probe's exit code where deep_ep does not import

PROBE = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from megatron_serve.config import InferenceConfig
    from megatron_serve.engine.experts.backend import install_expert_backend
    from megatron_serve.model.experts.dispatch import install_dispatchers
    from megatron_serve.model.loader import load_model
    from megatron_serve.model.experts.moe import SparseMoeBlock
    from megatron_serve.model.parallel import TensorParallel
    from megatron_serve.model.experts.token_dispatcher import AllToAllDispatcher

    model_dir, rank, size, port, mode = sys.argv[1:]
    rank, size = int(rank), int(size)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    tp = TensorParallel(rank, size, dist.group.WORLD, expert_parallel=True)
    one = load_model(model_dir, torch.bfloat16, "cuda")  # the reference: every expert on this GPU
    model = load_model(model_dir, torch.bfloat16, "cuda", tp)
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    references = [layer.mlp for layer in one.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    if mode == "deepep":
        try:
            import deep_ep  # noqa: F401
        except Exception as exc:
            print(f"deep_ep does not import: {exc}")
            sys.exit(3)
    for block in blocks:  # a group of one: give the layers their all-to-all as a group of several has
        block.dispatcher = block.dispatcher or AllToAllDispatcher(tp, block.experts.num_experts)

    def inputs(tokens):
        return torch.randn(tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(tokens)).to(
            "cuda", torch.bfloat16)

    def check(got, block_index, hidden, what):
        expected = references[block_index](hidden)
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2, msg=what)

    with torch.inference_mode():
        if mode == "capacity":
            step = install_dispatchers(model, "alltoall")
            control = inputs(3)
            torch.cuda.set_sync_debug_mode("error")
            try:
                blocks[0](control)  # exact counts: .tolist() must raise
                raise SystemExit("the control: the exact all-to-all synchronized without an error")
            except RuntimeError as exc:
                assert "synchroniz" in str(exc), exc
            torch.cuda.set_sync_debug_mode("default")
            for tokens, capacity in ((1, 1), (3, 4), (37, 40)):
                step.capacity = capacity
                static, fresh = inputs(tokens), inputs(tokens + 100)[:tokens]
                for index, block in enumerate(blocks):
                    torch.cuda.set_sync_debug_mode("error")  # the eager pass: no host synchronization
                    eager = block(static)
                    torch.cuda.set_sync_debug_mode("default")
                    check(eager, index, static, f"eager, {tokens} tokens")
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        block(static)
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                        captured = block(static)
                    saved = static.clone()
                    static.copy_(fresh)
                    graph.replay()
                    torch.cuda.synchronize()
                    check(captured, index, fresh, f"replayed, {tokens} tokens")
                    static.copy_(saved)
        else:
            for backend in ("deepep_low_latency", "deepep_high_throughput"):
                config = InferenceConfig(device="cuda", all2all_backend=backend, max_requests=32)
                step = install_expert_backend(model, config)
                for tokens in (1, 3, 37):  # low-latency mode up to 64 tokens (the graphs of 32 requests)
                    for index, block in enumerate(blocks):
                        check(block(inputs(tokens)), index, inputs(tokens), f"{backend}, {tokens} tokens")
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """Qwen3-MoE of DeepEP's smallest low-latency hidden size (2048): 8 experts, top-2, two layers."""
    return str(make_tiny_model(tmp_path_factory.mktemp("moe"), seed=1, arch="qwen3_moe", hidden_size=2048,
                               num_layers=2, num_heads=16, num_kv_heads=4, intermediate_size=1024, num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=512))


def probe(model_dir: str, size: int, mode: str) -> list[int]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, model_dir, str(rank), str(size), str(port), mode],
                              cwd=ROOT) for rank in range(size)]
    return [p.wait(timeout=600) for p in procs]


def test_fixed_capacity_all_to_all_replays_in_a_cuda_graph_without_host_synchronization(moe_dir):
    size = 2 if GPUS >= 2 else 1
    assert probe(moe_dir, size, "capacity") == [0] * size


@pytest.mark.skipif(GPUS < 2, reason="EP=2 needs two GPUs (NCCL refuses two ranks on one)")
def test_deepep_modes_give_one_ranks_moe_outputs(moe_dir):
    codes = probe(moe_dir, 2, "deepep")
    if codes == [SKIPPED] * 2:
        pytest.skip("deep_ep does not import on this machine")
    assert codes == [0, 0]


@pytest.mark.skipif(GPUS < 2, reason="EP=2 needs two GPUs (NCCL refuses two ranks on one)")
@pytest.mark.parametrize("backend", ["alltoall", "auto"])
def test_an_expert_parallel_engine_replaying_graphs_gives_its_eager_tokens(moe_dir, backend):
    """float32 (DeepEP is not used there: ``auto`` takes ``alltoall``), greedy, requests together then one alone."""
    if backend == "auto" and importlib.util.find_spec("deep_ep") is None:
        pytest.skip("auto is alltoall without deep_ep: the other case")
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=16, ignore_eos=True)
    dtype = "bfloat16" if backend == "auto" else "float32"
    runs = {}
    for graphs in (True, False):
        llm = MegatronLLM(moe_dir, InferenceConfig(device="cuda", dtype=dtype, tensor_parallel_size=2,
                                                   enable_expert_parallel=True, all2all_backend=backend,
                                                   enable_cuda_graphs=graphs, max_requests=8))
        try:
            assert (llm.engine.worker.runner.graphs is not None) == graphs
            runs[graphs] = [[o.generated_tokens for o in llm.generate(list(prompts), params)]
                            for prompts in (PROMPTS[:4], PROMPTS[4:5])]
        finally:
            llm.close()
    assert runs[True] == runs[False]
