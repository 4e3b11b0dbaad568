"""Data-parallel attention (``data_parallel_size`` with ``enable_expert_parallel``) on CPU over gloo, one process
per data-parallel rank (each an engine with its own requests) and per tensor-parallel rank: tiny Qwen3-MoE, Qwen2-MoE
(a replicated shared expert) and Mixtral at DP 2 (Qwen3-MoE at DP 4 too) give one rank's and ``transformers``' greedy
tokens and routing, with requests on every rank and with one request alone (the other ranks idle and join each MoE layer
empty); under ``--batch-invariant`` one rank's log probs ``==``, with the control that an unordered combine breaks
that. FP8 experts, the prefix cache and preemption at DP 2 give one rank's tokens.

At TP 1 every rank's attention is whole, so the engine is bitwise one rank's; at DP 2 x TP 2 (4 processes)
attention is split as at TP 2, and in the batch-invariant mode still bitwise one rank's, as expert parallelism over 2
and 4 tensor-parallel ranks without data-parallel attention is (the row-parallel layers gather their input, with the
control that partial sums break it). One group of processes per layout serves every case of it, one engine after another
(``data_parallel_runs.serve_cases``): starting the processes costs more than a case."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
import transformers

from megatron_serve import InferenceConfig, SamplingParams
from megatron_serve.engine.group.data_parallel import agree_turn
from megatron_serve.engine.group.placement import data_parallel_placement
from megatron_serve.engine.group.turns import HeldVerb
from megatron_serve.model.loader import build_model, load_model
from megatron_serve.model.parallel import DataParallel, TensorParallel
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.tokenizer import Tokenizer
from megatron_serve.wire.request import DynamicInferenceRequest, EventType

from ..forked import forked_reports, report
from ..fp8_checkpoints import block_fp8_checkpoint
from ..helpers import free_port
from ..model.test_moe import VARIANTS, hf_greedy_with_routing
from ..prompts import PROMPTS
from .data_parallel_runs import Case, Launcher, Request, Served, graph_log, serve_cases

ALONE = PROMPTS[4:5]
# Each rank's prompts served together (first run), then rank 0's one request alone while the others idle (second):
# at DP 2 rank 1 serves two; at DP 4 ranks 1 and 2 one each and rank 3 idles through both runs.
SPLITS = {1: [PROMPTS[:4]], 2: [PROMPTS[:2], PROMPTS[2:4]], 4: [PROMPTS[:2], PROMPTS[2:3], PROMPTS[3:4], []]}
# At 4 ranks (DP 4, and EP over TP 4) one family only: the other two at 4 repeat what they check at 2 (their own
# code paths: Mixtral's block_sparse_moe, Qwen2-MoE's replicated shared expert), while what 4 adds (ranks 1 and 2
# one request each, rank 3 idle through both runs; 4 experts a rank) is the layout's, not the family's.
FOUR_RANKS_ARCH = "qwen3_moe"
GREEDY_TOKENS = 16  # decode steps with one request alone (the others idle); each token costs every rank a step
INVARIANT_TOKENS = 8
FEATURES = dict(num_kv_blocks=10, max_batch_tokens=64, enable_prefix_caching=True)  # a pool of about two requests
# steps captured and replayed (a CPU stand-in for CUDA graphs): decode batches of 1 to 4, mixed steps of up to 8 tokens
GRAPHS = dict(dtype="float32", max_requests=4, cuda_graph_sizes=[1, 2, 4, 8], all2all_backend="alltoall")


def _params(new_tokens: int, routing: bool = True) -> SamplingParams:
    return SamplingParams(temperature=0.0, num_tokens_to_generate=new_tokens, ignore_eos=True, return_log_probs=True,
                          return_routing_indices=routing)


def split_runs(dp: int, new_tokens: int) -> list[list[list[Request]]]:
    """Each rank's runs: its share of four prompts together, then the one alone on rank 0 (the others idle)."""
    runs = []
    for rank, prompts in enumerate(SPLITS[dp]):
        together = [Request(f"d{rank}-{i}", p, _params(new_tokens)) for i, p in enumerate(prompts)]
        runs.append([together, [Request("alone", p, _params(new_tokens)) for p in ALONE] if rank == 0 else []])
    return runs


def feature_runs(dp: int) -> list[list[list[Request]]]:
    """A pool of about two requests per rank (preemption), then each rank's longest prompt again without routing
    (a request that records its routing computes every token itself): the prefix cache serves its blocks."""
    runs = []
    for rank, prompts in enumerate(SPLITS[dp]):
        mine = prompts + (ALONE if rank == 0 else [])
        longest = max(range(len(mine)), key=lambda i: len(mine[i]))
        runs.append([[Request(f"d{rank}-{i}", p, _params(GREEDY_TOKENS)) for i, p in enumerate(mine)],
                     [Request(f"again-{rank}-{longest}", mine[longest], _params(GREEDY_TOKENS, routing=False))]])
    return runs


def layout_cases(dp: int, tp: int, models: dict[str, str]) -> list[Case]:
    """Every case a layout serves: per model greedy float32 and batch-invariant bfloat16 (and the control, beside
    other ranks); at DP 1 and 2 FP8 experts; at DP 2 the prefix cache under preemption (and with a host tier). With tensor-parallel ranks:
    per model batch-invariant bfloat16 (and at TP 2 the control, partial sums in the row-parallel layers); at DP 2 x
    TP 2 Qwen2-MoE greedy and batch-invariant."""
    invariant = dict(dtype="bfloat16", batch_invariant=True)
    graphs = Case("qwen3_moe:graphs", models["qwen3_moe"], split_runs(dp, GREEDY_TOKENS), GRAPHS, graphs=True)
    if tp > 1 and dp > 1:
        return [Case("qwen2_moe:greedy", models["qwen2_moe"], split_runs(dp, INVARIANT_TOKENS), dict(dtype="float32")),
                Case("qwen2_moe:invariant", models["qwen2_moe"], split_runs(dp, INVARIANT_TOKENS), invariant)]
    archs = [FOUR_RANKS_ARCH] if dp * tp == 4 else sorted(VARIANTS)
    if tp > 1:
        cases = [Case(f"{arch}:invariant", models[arch], split_runs(dp, INVARIANT_TOKENS), invariant)
                 for arch in archs]
        return cases + [Case(f"{arch}:partial_sums", models[arch], split_runs(dp, INVARIANT_TOKENS), invariant,
                             partial_sums=True) for arch in sorted(VARIANTS) if tp == 2] + [graphs] * (tp == 2)
    cases = []
    for arch in archs:
        model_dir = models[arch]
        cases.append(Case(f"{arch}:greedy", model_dir, split_runs(dp, GREEDY_TOKENS), dict(dtype="float32")))
        cases.append(Case(f"{arch}:invariant", model_dir, split_runs(dp, INVARIANT_TOKENS), invariant))
        if dp > 1:
            cases.append(Case(f"{arch}:unordered", model_dir, split_runs(dp, INVARIANT_TOKENS), invariant,
                              unordered=True))
    if dp < 4:
        cases.append(Case("fp8", models["fp8"], split_runs(dp, INVARIANT_TOKENS), dict(kv_cache_dtype="fp8")))
    if dp == 2:
        cases += [Case("features", models["qwen3_moe"], feature_runs(dp), dict(dtype="float32", **FEATURES)), graphs,
                  Case("host_tier", models["qwen3_moe"], feature_runs(dp),
                       dict(dtype="float32", kv_offloading_size=0.01, **FEATURES))]
    return cases


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The three tiny MoE models, and Qwen2-MoE with block FP8 experts (16x16 blocks)."""
    made = {arch: str(make_tiny_model(tmp_path_factory.mktemp(arch), seed=1, num_heads=4, num_kv_heads=2,
                                      **VARIANTS[arch])) for arch in VARIANTS}
    base = make_tiny_model(tmp_path_factory.mktemp("fp8-base"), seed=5, arch="qwen2_moe", num_heads=4, num_kv_heads=2)
    made["fp8"] = str(block_fp8_checkpoint(base, tmp_path_factory.mktemp("fp8"), (16, 16)))
    return made


@pytest.fixture(scope="module")
def served(models, tmp_path_factory) -> Iterator[Callable[[int, int], Served]]:
    """``served(dp, tp)``: every case of that layout, served by one group of processes the first time it is asked;
    every layout's group forked from one launcher."""
    cache: dict[tuple[int, int], Served] = {}
    root = tmp_path_factory.mktemp("served")

    with Launcher() as launcher:
        def get(dp: int, tp: int = 1) -> Served:
            if (dp, tp) not in cache:
                # TP 4's ranks too are forked from the launcher: spawned by the engine, they came from a fork server
                # (an interpreter importing torch again, some 2-3 CPU-s) for the layout's one case
                cache[dp, tp] = serve_cases(root / f"dp{dp}-tp{tp}", layout_cases(dp, tp, models), tp=tp,
                                            launcher=launcher)
            return cache[dp, tp]

        get.root = root  # where each layout's group keeps its files (graph logs)
        yield get


@pytest.fixture(scope="module")
def hf_reference(models) -> Iterator[Callable[[str], dict[str, tuple[list[int], np.ndarray]]]]:
    """``hf_reference(arch)``: ``transformers``' greedy tokens and routing of each prompt alone."""
    cache: dict[str, dict] = {}

    def get(arch: str) -> dict[str, tuple[list[int], np.ndarray]]:
        if arch not in cache:
            hf = transformers.AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32).eval()
            tokenizer = Tokenizer.from_pretrained(models[arch])
            cache[arch] = {p: hf_greedy_with_routing(hf, tokenizer.encode(p), GREEDY_TOKENS) for p in PROMPTS[:5]}
        return cache[arch]

    yield get


def rows(requests: list[DynamicInferenceRequest]) -> list[list]:
    return [[r.generated_tokens, r.generated_log_probs,
             None if r.routing_indices is None else r.routing_indices.tolist()] for r in requests]


def by_request(ranks: list[list[list[DynamicInferenceRequest]]]) -> list[list[list]]:
    """The split runs in one rank's order: the requests together (rank 0's, then rank 1's...), then the one alone."""
    return [rows([r for rank in ranks for r in rank[0]]), rows(ranks[0][1])]


def by_prompt(ranks: list[list[list[DynamicInferenceRequest]]]) -> dict[str, list]:
    """Each prompt's row of a split case's runs (its one alone and together runs hold different prompts)."""
    return {(PROMPTS[:4] + ALONE)[i]: row for i, row in enumerate(sum(by_request(ranks), []))}


def assert_same_runs(got: list[list], expected: list[list]) -> None:
    """Tokens and routing equal, log probs within float32 noise (attention at another batch shape)."""
    for got_run, expected_run in zip(got, expected, strict=True):
        for (tokens, log_probs, routing), (tokens_1, log_probs_1, routing_1) in zip(got_run, expected_run, strict=True):
            assert tokens == tokens_1 and routing == routing_1
            assert log_probs == pytest.approx(log_probs_1, abs=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("arch, dp", [(arch, 2) for arch in sorted(VARIANTS)] + [(FOUR_RANKS_ARCH, 4)])
def test_greedy_tokens_and_routing_equal_one_rank_and_transformers(served, hf_reference, arch, dp):
    one = by_request(served(1)[f"{arch}:greedy"])
    got = by_request(served(dp)[f"{arch}:greedy"])
    assert_same_runs(got, one)
    reference = hf_reference(arch)
    for prompt, (tokens, _, routing) in zip(PROMPTS[:4] + ALONE, got[0] + got[1]):
        expected_tokens, expected_routing = reference[prompt]
        assert tokens == expected_tokens
        np.testing.assert_array_equal(np.array(routing), expected_routing)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("arch, dp", [(arch, 2) for arch in sorted(VARIANTS)] + [(FOUR_RANKS_ARCH, 4)])
def test_batch_invariant_log_probs_equal_one_rank_and_not_without_the_ordered_combine(served, arch, dp):
    """bfloat16, ``--batch-invariant``: tokens, routing and log probs ``==`` one rank's, together and alone. The
    control swaps the ordered combine for the default float32 sum in every rank: its log probs differ."""
    one = by_request(served(1)[f"{arch}:invariant"])
    assert by_request(served(dp)[f"{arch}:invariant"]) == one
    unordered = by_request(served(dp)[f"{arch}:unordered"])
    assert [[row[1] for row in run] for run in unordered] != [[row[1] for row in run] for run in one], \
        "the control (an unordered combine) gives one rank's log probs too: the equality proves nothing"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_data_parallel_ranks_of_two_tensor_parallel_ranks_equal_one_rank(served):
    """4 processes: attention split over 2 ranks in each data-parallel rank, experts over all 4 (Qwen2-MoE: the
    shared expert replicated, on each rank's chunk of its data-parallel rank's tokens); under ``--batch-invariant``
    log probs ``==`` one rank's (the row-parallel layers gather their input)."""
    one = by_prompt(served(1)["qwen2_moe:greedy"])
    got = by_prompt(served(2, 2)["qwen2_moe:greedy"])
    for prompt, (tokens, log_probs, routing) in got.items():
        tokens_1, log_probs_1, routing_1 = one[prompt]
        assert tokens == tokens_1[:len(tokens)] and routing == routing_1[:len(routing)]
        assert log_probs == pytest.approx(log_probs_1[:len(log_probs)], abs=1e-4)
    assert by_request(served(2, 2)["qwen2_moe:invariant"]) == by_request(served(1)["qwen2_moe:invariant"])


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("arch, tp", [(arch, 2) for arch in sorted(VARIANTS)] + [(FOUR_RANKS_ARCH, 4)])
def test_expert_parallelism_over_tensor_parallel_ranks_is_one_rank_bitwise_in_the_batch_invariant_mode(
        served, arch, tp):
    """EP over 2 and 4 tensor-parallel ranks, bfloat16, ``--batch-invariant``: tokens, routing and log probs ``==``
    one rank's, together and alone. The MoE layers combine in ascending expert order; attention's ``o_proj`` and
    the dense layers' ``down_proj`` gather their input and compute their slice of the output from all of it
    (``GatheredRowLinear``). The control adds the ranks' partial sums instead, in rank order: its log probs differ."""
    one = by_request(served(1)[f"{arch}:invariant"])
    assert by_request(served(1, tp)[f"{arch}:invariant"]) == one
    partial_sums = by_request(served(1, 2)[f"{arch}:partial_sums"])
    assert [[row[1] for row in run] for run in partial_sums] != [[row[1] for row in run] for run in one], \
        "the control (partial sums in the row-parallel layers) gives one rank's log probs too: the equality proves nothing"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("dp, tp", [(2, 1), (1, 2)])
def test_steps_replayed_from_graphs_equal_one_rank(served, dp, tp):
    """Expert parallelism with CUDA graphs (a CPU stand-in replays a step by running the captured forward again
    over the same static buffers): over 2 tensor-parallel ranks every rank replays the same graph; with data-parallel
    attention the ranks agree on the step's largest token count and pad to one graph size, so a rank replays its
    graph while another runs its empty MoE pass with buffers of the same size (the one request alone). Greedy tokens
    and routing equal one rank's, together and alone; every rank replayed graphs."""
    assert_same_runs(by_request(served(dp, tp)["qwen3_moe:graphs"]), by_request(served(1)["qwen3_moe:greedy"]))
    log = graph_log(served.root / f"dp{dp}-tp{tp}", "qwen3_moe:graphs")
    assert len(log) == 2 and all(any(line.startswith("replay ") for line in lines) for lines in log.values()), log
    if dp > 1:  # the idle rank's empty passes had the graphs' buffers (exact counts beside a prefill above them)
        empty = [line for lines in log.values() for line in lines if line.startswith("empty ")]
        assert any(line != "empty None" for line in empty), empty


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fp8_experts_equal_one_rank(served):
    """Block FP8 experts and an FP8 KV cache: each rank reads its experts' e4m3 data and scales."""
    assert_same_runs(by_request(served(2)["fp8"]), by_request(served(1)["fp8"]))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_preemption_and_the_prefix_cache_change_nothing(served):
    """A pool of about two requests on each rank (preemptions, recomputed), then prompts again (the prefix cache
    serves them): every request's tokens and routing are one rank's in a roomy pool; and so with a host KV tier."""
    one = by_prompt(served(1)["qwen3_moe:greedy"])
    ranks = served(2)["features"]
    first = [r for rank in ranks for r in rank[0]]
    again = [r for rank in ranks for r in rank[1]]
    assert any(any(e.type is EventType.PREEMPT for e in r.events) for r in first), "nothing was preempted"
    assert all(r.cached_tokens > 0 for r in again), [r.cached_tokens for r in again]
    prompts = {f"d{rank}-{i}": prompt for rank, mine in enumerate(SPLITS[2])
               for i, prompt in enumerate(mine + (ALONE if rank == 0 else []))}
    for request in first:
        tokens, log_probs, routing = one[prompts[request.request_id]]
        assert request.generated_tokens == tokens and request.routing_indices.tolist() == routing
        assert request.generated_log_probs == pytest.approx(log_probs, abs=1e-4)
    for request in again:
        assert request.generated_tokens == one[prompts[request.request_id.replace("again-", "d", 1)]][0]
    with_tier = served(2)["host_tier"]  # each data-parallel rank with a host tier of its own: the same tokens
    assert [[r.generated_tokens for r in run] for rank in with_tier for run in rank] == [
        [r.generated_tokens for r in run] for rank in ranks for run in rank]


@pytest.mark.parametrize("arch", sorted(VARIANTS))
def test_experts_split_over_every_rank_of_every_data_parallel_rank(models, arch):
    """Data-parallel rank 1's tensor-parallel rank 0 of 2 x 2 holds the third quarter of the experts."""
    model_dir = models[arch]
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
    experts (and half of attention), and the engines serve the new weights' tokens: though the second engine gets its
    copy of the refit many turns of their lockstepped loops after the first (``late_refit/sitecustomize.py``), which
    acting on its copy at once would wait for in the transfer, while the second waited for it in the loop's turn."""
    import os

    from megatron_serve import MegatronLLM, SamplingParams, WeightSender
    from megatron_serve.client.coordinator_client import InferenceClient
    from megatron_serve.model.loader import checkpoint_tensors
    from megatron_serve.wire.request import RequestStatus

    from ..helpers import Children, hosted_rendezvous

    model_dir, new_dir = (str(make_tiny_model(tmp_path / name, seed=seed, num_heads=4, num_kv_heads=2,
                                              **VARIANTS["qwen3_moe"])) for name, seed in (("m", 1), ("n", 2)))
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True)
    prompts = [f"Data-parallel request {i}: the quick brown fox" for i in range(8)]  # both engines' 4 slots
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
    with hosted_rendezvous(4) as rendezvous:  # the engines' 2 x 2 ranks meet at a store hosted here
        try:
            children.coordinator(model_dir, port)
            late = {"LATE_REFIT_S": "0.5", "PYTHONPATH": os.pathsep.join([
                os.path.join(os.path.dirname(__file__), "late_refit"), os.environ.get("PYTHONPATH", "")])}
            for rank in range(2):
                children.engine(model_dir, port, "--dtype", "float32", "--device", "cpu", "--data-parallel-size", "2",
                                "--data-parallel-rank", str(rank), "--tensor-parallel", "2", "--enable-expert-parallel",
                                "--max-requests", "4", env={**rendezvous, **(late if rank else {})})
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


def test_a_refit_that_reaches_data_parallel_ranks_at_different_turns_runs_on_all_at_one_turn():
    """The race a whole-suite run hit: each engine's copy of a trainer's refit arrives on its own link, so one engine
    may get it a turn of the lockstepped step loop later than another. Acting at once, the first would wait in the
    transfer for the second, while the second waits in the turn's all-reduce for the first (until the transfer timed
    out, missing the second engine's ranks). Held, every leader acts at the first turn in which all hold theirs."""
    arrivals = [0, 5]  # the copies reach the two leaders at turns 0 and 5 (a third, between, adds only a process)
    port = free_port()
    failed, said = forked_reports(lead, [(rank, len(arrivals), arrives, port) for rank, arrives in enumerate(arrivals)])
    assert failed == 0
    acted = [[turn for rank_, turn in said if rank_ == str(rank)] for rank in range(len(arrivals))]
    assert acted == [["5"]] * len(arrivals), acted  # each one's own arrival turn would be [0, 5]: the hang


def lead(rank: int, world: int, arrives: int, port: int) -> None:
    """A data-parallel attention leader turning its step loop as an engine process does
    (``engine.process.loop.EngineProcess.run``): it gets its copy of the refit at turn ``arrives``, holds it, and
    reports the turn at which the leaders agreed to act on it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    held = None
    for turn in range(10):  # past the last arrival
        if turn == arrives:
            held = HeldVerb("REFIT", None, float("inf"))
        if agree_turn(dist.group.WORLD, busy=False, holding=held is not None).verb:
            report(rank, turn)
            break
    dist.destroy_process_group()
