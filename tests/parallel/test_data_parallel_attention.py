"""Data-parallel attention (``data_parallel_size`` with ``enable_expert_parallel``) on CPU over gloo, one process
per data-parallel rank (each an engine with its own requests) and per tensor-parallel rank: tiny Qwen3-MoE, Qwen2-MoE
(a replicated shared expert) and Mixtral give one rank's and ``transformers``' greedy tokens and routing, with
requests on every rank and with one request alone (the other rank idles and joins each MoE layer empty); under
``--batch-invariant`` one rank's log probs ``==``, with the control that an unordered combine breaks that.

At DP 2 x TP 1 every rank's attention is whole, so the engine is bitwise one rank's; at DP 2 x TP 2 (4 processes)
attention is split as at TP 2. DP 4 (4 engines) runs for one model: each case costs about a minute more on a 2-core
machine."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch
import transformers

from megatron_serve import InferenceConfig
from megatron_serve.engine.tensor_parallel import data_parallel_placement
from megatron_serve.model.loader import build_model, load_model
from megatron_serve.model.parallel import DataParallel, TensorParallel
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.tokenizer import Tokenizer

from ..model.test_moe import NEW_TOKENS, VARIANTS, hf_greedy_with_routing
from ..prompts import PROMPTS
from .data_parallel_runs import serve_data_parallel

ALONE = PROMPTS[4:5]
# rank 0 serves two requests then one alone; rank 1 two, then nothing (it idles through rank 0's lone request)
SPLIT = [[PROMPTS[:2], ALONE], [PROMPTS[2:4], []]]
ONE_RANK = [[PROMPTS[:4], ALONE]]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def moe_model(request, tmp_path_factory) -> tuple[str, str]:
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), seed=1, num_heads=4, num_kv_heads=2,
                           **VARIANTS[request.param])
    return request.param, str(path)


def by_request(ranks: list[list[list]]) -> list[list]:
    """The split runs in one rank's order: the requests together (rank 0's, then rank 1's...), then the one alone."""
    return [[row for rank in ranks for row in rank[0]], ranks[0][1]]


def assert_same_runs(got: list[list], expected: list[list]) -> None:
    """Tokens and routing equal, log probs within float32 noise (attention at another batch shape)."""
    for got_run, expected_run in zip(got, expected, strict=True):
        for (tokens, log_probs, routing), (tokens_1, log_probs_1, routing_1) in zip(got_run, expected_run, strict=True):
            assert tokens == tokens_1 and routing == routing_1
            assert log_probs == pytest.approx(log_probs_1, abs=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_greedy_tokens_and_routing_equal_one_rank_and_transformers(moe_model, tmp_path):
    _, model_dir = moe_model
    one = serve_data_parallel(model_dir, tmp_path, ONE_RANK, new_tokens=NEW_TOKENS)[0]
    dp = by_request(serve_data_parallel(model_dir, tmp_path, SPLIT, new_tokens=NEW_TOKENS))
    assert_same_runs(dp, one)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    for prompt, (tokens, _, routing) in zip(PROMPTS[:4] + ALONE, dp[0] + dp[1]):
        expected_tokens, expected_routing = hf_greedy_with_routing(hf, tokenizer.encode(prompt))
        assert tokens == expected_tokens
        np.testing.assert_array_equal(np.array(routing), expected_routing)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_data_parallel_ranks_of_two_tensor_parallel_ranks_equal_one_rank(tmp_path):
    """4 processes: attention split over 2 ranks in each data-parallel rank, experts over all 4 (Qwen2-MoE: the
    shared expert replicated, on each rank's chunk of its data-parallel rank's tokens)."""
    model_dir = str(make_tiny_model(tmp_path / "m", seed=1, num_heads=4, num_kv_heads=2, **VARIANTS["qwen2_moe"]))
    one = serve_data_parallel(model_dir, tmp_path, ONE_RANK)[0]
    dp = by_request(serve_data_parallel(model_dir, tmp_path, SPLIT, tp=2))
    assert_same_runs(dp, one)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_four_data_parallel_ranks_equal_one_rank(tmp_path):
    """4 engines, a quarter of Qwen3-MoE's 16 experts each; rank 3 idles through the requests of the others, ranks
    1-3 through rank 0's request alone."""
    model_dir = str(make_tiny_model(tmp_path / "m", seed=1, num_heads=4, num_kv_heads=2, **VARIANTS["qwen3_moe"]))
    one = serve_data_parallel(model_dir, tmp_path, ONE_RANK)[0]
    split = [[PROMPTS[:2], ALONE], [PROMPTS[2:3], []], [PROMPTS[3:4], []], [[], []]]
    dp = by_request(serve_data_parallel(model_dir, tmp_path, split))
    assert_same_runs(dp, one)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_batch_invariant_log_probs_equal_one_rank_and_not_without_the_ordered_combine(moe_model, tmp_path):
    """bfloat16, ``--batch-invariant``: tokens, routing and log probs ``==`` one rank's, together and alone. The
    control swaps the ordered combine for the default float32 sum in every rank: its log probs differ."""
    _, model_dir = moe_model
    options = dict(dtype="bfloat16", batch_invariant=True)
    one = serve_data_parallel(model_dir, tmp_path, ONE_RANK, **options)[0]
    assert by_request(serve_data_parallel(model_dir, tmp_path, SPLIT, **options)) == one
    unordered = by_request(serve_data_parallel(model_dir, tmp_path, SPLIT, unordered=True, **options))
    assert [[row[1] for row in run] for run in unordered] != [[row[1] for row in run] for run in one], \
        "the control (an unordered combine) gives one rank's log probs too: the equality proves nothing"


def test_experts_split_over_every_rank_of_every_data_parallel_rank(moe_model):
    """Data-parallel rank 1's tensor-parallel rank 0 of 2 x 2 holds the third quarter of the experts."""
    _, model_dir = moe_model
    config = load_model(model_dir, torch.float32, "meta").config
    tp = TensorParallel(0, 2, expert_parallel=True, data_parallel=DataParallel(1, 2))
    model = build_model(config, torch.float32, "meta", tp)
    experts = next(m for name, m in model.named_modules() if name.endswith("mlp.experts"))
    quarter = config.moe.num_experts // 4
    assert (experts.first_expert, experts.num_local_experts) == (2 * quarter, quarter)
    six = dataclasses.replace(config, moe=dataclasses.replace(config.moe, num_experts=6))
    with pytest.raises(ValueError, match="6 experts do not split over 4 expert-parallel ranks"):
        build_model(six, torch.float32, "meta", tp)


def test_bad_layouts_are_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="data_parallel_size 2 inside an engine group is data-parallel attention"):
        InferenceConfig(device="cpu", data_parallel_size=2)
    with pytest.raises(ValueError, match=r"data_parallel_rank must be an integer in \[0, 2\), got 2"):
        InferenceConfig(device="cpu", data_parallel_size=2, data_parallel_rank=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="data_parallel_size 2 does not serve pipeline_parallel_size > 1 yet"):
        InferenceConfig(device="cpu", data_parallel_size=2, enable_expert_parallel=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size 2 does not serve LoRA adapters yet"):
        InferenceConfig(device="cpu", data_parallel_size=2, enable_expert_parallel=True, enable_lora=True)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    config = InferenceConfig(device="cpu", data_parallel_size=2, data_parallel_rank=1, enable_expert_parallel=True,
                             tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"they meet at MASTER_ADDR:MASTER_PORT \(MASTER_ADDR, MASTER_PORT not set"):
        data_parallel_placement(config)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    placement = data_parallel_placement(config)
    assert (placement.world_size, placement.first_local_rank, placement.local_count) == (4, 2, 2)
    monkeypatch.setenv("NPROC_PER_NODE", "4")  # a pod of two data-parallel ranks: one engine cannot start both
    with pytest.raises(ValueError, match="NPROC_PER_NODE=4, but an engine of data-parallel attention starts its own 2"):
        data_parallel_placement(config)
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="WORLD_SIZE=8 does not match the group's 4 ranks"):
        data_parallel_placement(config)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_two_data_parallel_engines_behind_a_coordinator_serve_one_ranks_tokens(tmp_path):
    """``megatron-serve engine --data-parallel-size 2 --data-parallel-rank d --tensor-parallel 2
    --enable-expert-parallel`` twice, one group: the coordinator routes to each rank as to an engine, and each request
    streams one rank's tokens, with many requests and then with one alone (the other engine idles through it). A
    trainer's refit then reaches all four ranks, each with its own rank of the transfer and only its quarter of the
    experts (and half of attention), and the engines serve the new weights' tokens."""
    from megatron_serve import MegatronLLM, SamplingParams, WeightSender
    from megatron_serve.client.coordinator_client import InferenceClient
    from megatron_serve.engine.tensor_parallel import free_port as free_rendezvous_port
    from megatron_serve.model.loader import checkpoint_tensors
    from megatron_serve.wire.request import RequestStatus

    from ..helpers import Children, free_port

    model_dir, new_dir = (str(make_tiny_model(tmp_path / name, seed=seed, num_heads=4, num_kv_heads=2,
                                              **VARIANTS["qwen3_moe"])) for name, seed in (("m", 1), ("n", 2)))
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True)
    prompts = [f"Data-parallel request {i}: the quick brown fox" for i in range(12)]
    direct = {}
    for name, path in (("old", model_dir), ("new", new_dir)):
        one = MegatronLLM(path, InferenceConfig(dtype="float32", device="cpu", num_kv_blocks=64))
        try:
            direct[name] = {p: r.generated_tokens for p, r in zip(prompts, one.generate(prompts, params))}
        finally:
            one.close()
    assert direct["old"] != direct["new"]
    children = Children(tmp_path)
    port = free_port()
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_rendezvous_port())}
    try:
        children.coordinator(model_dir, port)
        for rank in range(2):
            children.engine(model_dir, port, "--dtype", "float32", "--device", "cpu", "--data-parallel-size", "2",
                            "--data-parallel-rank", str(rank), "--tensor-parallel", "2", "--enable-expert-parallel",
                            "--max-requests", "4", env=rendezvous)
        client = InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret)
        await client.start(timeout=60)
        await client.wait_for_engines(2, timeout=300)
        for batch in (prompts, prompts[:1]):
            results = await asyncio.wait_for(asyncio.gather(*(client.add_request(p, params) for p in batch)), 300)
            assert all(r.status is RequestStatus.COMPLETED for r in results)
            assert {p: r.generated_tokens for p, r in zip(batch, results)} == {p: direct["old"][p] for p in batch}

        await client.pause()
        tensors = list(checkpoint_tensors(new_dir))
        ack = await asyncio.wait_for(WeightSender(client, backend="gloo", timeout=120).send(tensors, epoch=1), 300)
        receivers = ack["detail"]["receivers"]
        experts = sum(t.numel() * t.element_size() for n, t in tensors if ".experts." in n)
        assert sorted(receivers) == [1, 2, 3, 4]  # the trainer, then each engine's two ranks: none collides
        assert all(experts / 4 <= f["bytes"] < experts / 4 + (sum(t.numel() * t.element_size() for _, t in tensors)
                                                              - experts) * 0.6 for f in receivers.values()), receivers
        await client.unpause()
        results = await asyncio.wait_for(asyncio.gather(*(client.add_request(p, params) for p in prompts)), 300)
        assert {p: r.generated_tokens for p, r in zip(prompts, results)} == direct["new"]
        assert all(set(r.policy_epochs) == {1} for r in results)
        client.close()
    finally:
        children.kill_all()
