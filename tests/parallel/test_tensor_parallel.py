"""Tensor parallelism with gloo on CPU (NCCL where each rank has a GPU): outputs equal TP=1, each rank loads its slice."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.model import UnsupportedModelError
from megatron_serve.model.tiny import make_tiny_model

from ..devices import tensor_parallel_device

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4", "def add(a, b): return a + b"]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=16, ignore_eos=True, return_log_probs=True)
DEVICE = tensor_parallel_device(4)  # TP=1, 2 and 4 on one device type, so that their outputs compare


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory) -> str:
    # 4 query heads over 2 KV heads: TP=2 splits KV heads, TP=4 replicates them (fewer KV heads than ranks).
    return str(make_tiny_model(tmp_path_factory.mktemp("gqa"), seed=3, num_heads=4, num_kv_heads=2))


@pytest.fixture(scope="module")
def mqa_tied_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("mqa"), seed=4, arch="qwen2", num_heads=4, num_kv_heads=1,
                               tie_word_embeddings=True))


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    # A shared expert (its partial sums join the routed experts' before the one all-reduce) and 8 experts
    # whose intermediate size 64 splits into 32 / 16 columns per rank.
    return str(make_tiny_model(tmp_path_factory.mktemp("moe"), seed=5, arch="qwen2_moe", num_heads=4,
                               num_kv_heads=2))


def generate(model_dir: str, tp: int, routing: bool = False):
    llm = MegatronLLM(model_dir, InferenceConfig(tensor_parallel_size=tp, block_size_tokens=8, device=DEVICE))
    try:
        outs = llm.generate(PROMPTS, SamplingParams(**{**GREEDY.to_dict(), "return_routing_indices": routing}))
        return ([o.generated_tokens for o in outs], [o.generated_log_probs for o in outs],
                [o.routing_indices.tolist() if routing else None for o in outs])
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("model_fixture, sizes", [("gqa_model", (2, 4)), ("mqa_tied_model", (2,)), ("moe_model", (2,))])
def test_tp2_and_tp4_equal_tp1(model_fixture, sizes, request):
    """TP=4 on the GQA model only, where it differs from TP=2 (KV heads replicated, fewer than ranks); the MQA model
    replicates its one KV head at TP=2 already, and the MoE model's 4-way column split of its experts is the 2-way's
    code (``test_expert_parallel`` runs MoE layers over 4 ranks)."""
    model_dir = request.getfixturevalue(model_fixture)
    routing = model_fixture == "moe_model"
    tokens_1, log_probs_1, routing_1 = generate(model_dir, 1, routing)
    for tp in sizes:
        tokens, log_probs, routing_tp = generate(model_dir, tp, routing)
        assert tokens == tokens_1, f"TP={tp} diverged"
        assert routing_tp == routing_1, f"TP={tp} routed differently"
        for row, expected in zip(log_probs, log_probs_1):
            assert row == pytest.approx(expected, abs=1e-4)


LOAD_PROBE = textwrap.dedent("""
    import json, os, sys, torch
    from megatron_serve.model.loader import load_model
    from megatron_serve.model.parallel import TensorParallel

    def anon_rss():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    # one process imports torch; each load runs in a child forked from it (memory as a fresh process's after import)
    model_dir, sizes = sys.argv[1], [int(size) for size in sys.argv[2:]]
    for size in sizes:
        pid = os.fork()
        if pid == 0:
            base = anon_rss()
            peak = [0]
            def progress(_name):
                peak[0] = max(peak[0], anon_rss() - base)
            model = load_model(model_dir, torch.float32, "cpu", TensorParallel(rank=size - 1, size=size), progress)
            local = sum(p.numel() * p.element_size() for p in model.parameters())
            print(json.dumps({"size": size, "peak": peak[0], "local_bytes": local}), flush=True)
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
""")


def test_each_rank_loads_about_one_nth_of_the_weights(tmp_path):
    # No process group is needed to load: this measures exactly what one rank's load allocates.
    model_dir = make_tiny_model(tmp_path / "big", seed=0, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                                intermediate_size=1024)
    full = None
    out = subprocess.run([sys.executable, "-c", LOAD_PROBE, str(model_dir), "1", "2", "4"], check=True,
                         capture_output=True, text=True)
    rows = [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("{")]
    assert [row["size"] for row in rows] == [1, 2, 4], out.stdout
    for size, measured in zip((1, 2, 4), rows):
        if size == 1:
            full = measured["local_bytes"]
            largest_tensor = 256 * 1024 * 4  # the MLP projections
        assert measured["local_bytes"] <= full / size * 1.1
        # allocator slack aside, a rank's peak is its slice plus at most one tensor being read
        assert measured["peak"] <= full / size + largest_tensor + (1 << 20), (size, measured, full)


def test_more_local_ranks_than_gpus_are_refused_before_any_rank_starts(gqa_model):
    gpus = torch.cuda.device_count()
    ranks = max(2, gpus + 1)
    with pytest.raises(ValueError, match=f"tensor_parallel_size {ranks} puts {ranks} ranks on this machine, but "
                                         f"{gpus} CUDA device\\(s\\) are visible"):
        MegatronLLM(gqa_model, InferenceConfig(tensor_parallel_size=ranks, device="cuda"))
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_a_start_that_fails_after_the_group_formed_leaves_no_group_behind(gqa_model, tmp_path):
    broken = shutil.copytree(gqa_model, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(Exception, match="safetensors|header"):
        MegatronLLM(str(broken), InferenceConfig(tensor_parallel_size=2, block_size_tokens=8, device=DEVICE))
    assert not dist.is_initialized() and multiprocessing.active_children() == []
    # the next engine in the same process forms its own group (it failed with "initialize the default
    # process group twice" before the failed start left its group)
    with MegatronLLM(gqa_model, InferenceConfig(tensor_parallel_size=2, block_size_tokens=8, device=DEVICE)) as llm:
        assert llm.generate(PROMPTS[:1], GREEDY)[0].generated_tokens


@pytest.mark.slow
def test_query_heads_that_do_not_split_over_the_ranks_are_refused_at_load(tmp_path):
    """One query head over two ranks: each rank kept the whole head while its o_proj took half the head's
    features, and the first forward pass failed with a shape error that lost the group (parity search
    case 11, engine against itself, TP=1 vs TP=2). It is refused at load, naming the heads."""
    model_dir = make_tiny_model(tmp_path, seed=1, num_heads=1, num_kv_heads=1)
    with pytest.raises(UnsupportedModelError, match="num_attention_heads=1 does not split over 2 tensor-parallel"):
        MegatronLLM(str(model_dir), InferenceConfig(tensor_parallel_size=2, block_size_tokens=8, device=DEVICE))
    assert not dist.is_initialized() and multiprocessing.active_children() == []
