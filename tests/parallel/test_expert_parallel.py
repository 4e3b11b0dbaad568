"""Expert parallelism (``enable_expert_parallel``) over the tensor-parallel ranks, on CPU over gloo: each rank reads
only its experts, an MoE layer's output equals one rank's (bitwise under ``--batch-invariant``, with the control
that an unordered combine breaks it), and engines of 2 and 4 ranks give one rank's and ``transformers``' tokens and
routing, for Qwen3-MoE, Qwen2-MoE (a shared expert, replicated) and Mixtral (engines of 4 ranks: Qwen3-MoE)."""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict

import numpy as np
import pytest
import torch
import torch.distributed as dist
import transformers

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.model.experts.capacity_dispatcher import CapacityDispatcher
from megatron_serve.model.experts.deepep_dispatcher import DeepEPBuffers, DeepEPDispatcher
from megatron_serve.model.experts.dispatch import install_dispatchers
from megatron_serve.model.experts.moe import SparseMoeBlock, expert_weight_name
from megatron_serve.model.experts.token_dispatcher import AllGatherDispatcher
from megatron_serve.model.loader import build_model, iterate_checkpoint, load_model, load_weights
from megatron_serve.model.parallel import DataParallel, TensorParallel
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.tokenizer import Tokenizer

from .. import deepep_fake
from ..devices import tensor_parallel_device
from ..forked import fork_ranks
from ..helpers import free_port
from ..host_sync import NoHostSync
from ..model.test_moe import VARIANTS, hf_greedy_with_routing
from ..prompts import PROMPTS

HEADS = dict(num_heads=4, num_kv_heads=2)  # splits over 2 and 4 tensor-parallel ranks


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    """``{arch: model directory}``: 16 experts (Qwen3-MoE) or 8, so that 2 and 4 ranks hold whole experts."""
    return {arch: str(make_tiny_model(tmp_path_factory.mktemp(arch), seed=1, **HEADS, **VARIANTS[arch]))
            for arch in sorted(VARIANTS)}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def moe_model(request, moe_models) -> tuple[str, str]:
    """``(arch, model directory)``."""
    return request.param, moe_models[request.param]


class Recording:
    """A safetensors slice that notes whose data was read (a rank must never read another rank's experts)."""

    def __init__(self, name: str, source, reads: list[str]):
        self.name, self.source, self.reads = name, source, reads

    def get_shape(self):
        return self.source.get_shape()

    def get_dtype(self):
        return self.source.get_dtype()

    def __getitem__(self, index):
        self.reads.append(self.name)
        return self.source[index]


def expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name)


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_reads_and_holds_only_its_experts(moe_model, size):
    _, model_dir = moe_model
    full = load_model(model_dir, torch.float32, "cpu")
    num_experts = full.config.moe.num_experts
    for rank in range(size):
        tp = TensorParallel(rank, size, expert_parallel=True)
        model = build_model(full.config, torch.float32, "cpu", tp)
        reads: list[str] = []
        load_weights(model, ((name, Recording(name, source, reads)) for name, source in iterate_checkpoint(model_dir)))
        read_experts = defaultdict(set)
        for name in reads:
            layer, _, _, expert = expert_weight_name(name)
            if expert is not None:
                read_experts[layer].add(expert)
        per_rank = num_experts // size
        assert read_experts and all(experts == set(range(rank * per_rank, (rank + 1) * per_rank))
                                    for experts in read_experts.values()), read_experts
        for (name, mine), (_, whole) in zip(model.named_parameters(), full.named_parameters()):
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                assert torch.equal(mine, whole[rank * per_rank:(rank + 1) * per_rank]), name
        assert expert_bytes(model) * size == expert_bytes(full)


def guarded(method):
    """``method`` run under :class:`NoHostSync`: the fixed-capacity dispatcher never reads a value on the host (a
    capture forbids it)."""
    def run(self, *args):
        with NoHostSync():
            return method(self, *args)
    return run


def probe(model_dirs: list[str], rank: int, size: int, port: int, out: str, cases: list[str]) -> None:
    """Rank ``rank`` of ``size``, a child forked from the test's process (:func:`layer_outputs`): every case of its
    group for every model, its MoE layers' outputs saved to ``out``."""
    for name in ("dispatch", "combine", "gather"):  # in this child alone: the test's process keeps the dispatcher's own
        setattr(CapacityDispatcher, name, guarded(getattr(CapacityDispatcher, name)))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    over_tp = TensorParallel(rank, size, dist.group.WORLD, expert_parallel=size > 1)
    over_dp = TensorParallel(0, 1, expert_parallel=True, data_parallel=DataParallel(rank, size, dist.group.WORLD))
    results = {}
    # each (model, dtype, layout)'s weights as its first case loaded them: the cases after it build the model and
    # copy them in (the load, reading and checking every tensor, cost some 40 % of a rank's CPU when each case did)
    loaded = {}
    # one group computes every case of its size for every model: a rank's start costs more than a case
    for model_dir, case in ((m, c) for m in model_dirs for c in cases):
        dtype, mode = case.split(":")
        one = mode.startswith("one-")  # one rank alone, computed by each rank of the group beside its cases
        mode = mode.removeprefix("one-")
        dp = mode.startswith("dp-")
        parallel = TensorParallel() if one else over_dp if dp else over_tp
        key = model_dir, dtype, "one" if one else "dp" if dp else "tp"
        if key in loaded:
            config, weights = loaded[key]
            model = build_model(config, getattr(torch, dtype), "cpu", parallel)
            model.load_state_dict(weights)
        else:
            model = load_model(model_dir, getattr(torch, dtype), "cpu", parallel)
            loaded[key] = model.config, {name: t.clone() for name, t in model.state_dict().items()}
        step = install_dispatchers(model, "alltoall") if "capacity" in mode else None
        if "deepep" in mode:  # DeepEP's dispatcher over the fake deep_ep; a mode's limit keeps it in one mode
            tp, experts = over_dp if dp else over_tp, model.config.moe.num_experts
            group = tp.data_parallel.group if dp else tp.group
            buffers = DeepEPBuffers(deepep_fake, group, model.config.hidden_size, experts, 40)
            limit = 64 if "low-latency" in mode else 0
            step = install_dispatchers(
                model, "deepep_low_latency",
                lambda block, step: DeepEPDispatcher(block.tp, experts, buffers, step, limit))
            deepep_fake.Buffer.calls.clear()
        if "invariant" in mode:
            model.use_batch_invariant_ops()
        outputs = results[model_dir, case] = []
        for layer in model.model.layers:
            block = layer.mlp
            if not isinstance(block, SparseMoeBlock):
                continue
            if "allgather" in mode and size > 1:
                block.dispatcher = AllGatherDispatcher(over_tp, model.config.moe.num_experts)
            if "unordered" in mode and size > 1:
                block.dispatcher.ordered = False
            # over TP ranks every rank has the step's tokens (one token: all but one chunk empty); with
            # data-parallel attention each rank its own count in each round, one rank idle (0)
            rounds = [[(1, 3, 37, 0)[(i + r) % 4] for r in range(size)] for i in range(4)] if dp else \
                [[tokens] * size for tokens in (1, 3, 37)]
            for counts in rounds:
                tokens = counts[rank]
                if step is not None and "capacity" in mode:  # buffers for more tokens than any rank has, as in
                    step.capacity = max(counts) + 3  # a padded graph
                elif step is not None:
                    step.tokens = max(counts)  # (data-parallel ranks agree on it: DeepEP's mode follows it)
                hidden = torch.randn(tokens, model.config.hidden_size,
                                     generator=torch.Generator().manual_seed(tokens))
                with torch.no_grad():
                    outputs.append((tokens, block(hidden.to(model.dtype))))
        if "deepep" in mode:
            results[model_dir, case + "#calls"] = sorted(deepep_fake.Buffer.calls)
    torch.save(results, out)
    dist.destroy_process_group()


#: The ``dtype:mode`` cases each world size computes, for the layer tests: ``capacity`` the fixed-capacity
#: all-to-all, ``dp-`` data-parallel attention over every rank (each its own tokens), ``one-`` one rank alone (the
#: baseline, computed in the group of 2 rather than in a process of its own: a process's start costs more).
LAYER_CASES = {2: ["float32:one-plain", "bfloat16:one-invariant",
                   "float32:plain", "float32:allgather", "bfloat16:invariant", "bfloat16:invariant-unordered",
                   "float32:capacity", "bfloat16:invariant-capacity", "bfloat16:invariant-capacity-unordered",
                   "float32:dp-plain", "float32:dp-capacity", "bfloat16:dp-invariant-capacity",
                   "float32:deepep-normal", "float32:deepep-low-latency", "float32:dp-deepep-low-latency"],
               4: ["float32:plain", "bfloat16:invariant", "float32:capacity", "bfloat16:invariant-capacity",
                   "float32:dp-capacity", "bfloat16:dp-invariant-capacity"]}


def layer_outputs(model_dirs: list[str], tmp_path) -> dict[int, dict[tuple[str, str], list]]:
    """``{size: outputs}``: every MoE layer's ``(tokens, output)`` for 1, 3 and 37 tokens on ``size`` real processes
    over gloo (every size's group at once, each rank forked from one process), for each model and each of the size's
    cases, by ``(model directory, case)``: rank 0's (every rank ends the layer with every token's output), and under
    data-parallel attention every rank's in rank order (each its own tokens)."""
    ranks = []
    for size, cases in LAYER_CASES.items():  # every rank a child forked from this process, which has imported torch
        port = free_port()
        ranks += [(model_dirs, rank, size, port, str(tmp_path / f"{size}-{rank}.pt"), cases) for rank in range(size)]
    assert fork_ranks(probe, ranks, timeout=300) == 0
    return {size: merged_ranks([torch.load(tmp_path / f"{size}-{rank}.pt") for rank in range(size)])
            for size in LAYER_CASES}


def merged_ranks(outputs: list[dict]) -> dict[tuple[str, str], list]:
    """A group's ranks' outputs as one: rank 0's, checked equal to every other rank's, where every rank has every
    token's; every rank's in rank order under data-parallel attention (and DeepEP's calls)."""
    merged = {}
    for key, mine in outputs[0].items():
        case = key[1]
        if case.endswith("#calls") or ":dp-" in case:
            merged[key] = [rank[key] for rank in outputs]
            continue
        for other in outputs[1:]:
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(mine, other[key], strict=True)), key
        merged[key] = [output for _, output in mine]
    return merged


def by_tokens(one: list[torch.Tensor]) -> dict[tuple[int, int], torch.Tensor]:
    """One rank's outputs by (MoE layer, tokens)."""
    return {(index // 3, (1, 3, 37)[index % 3]): output for index, output in enumerate(one)}


def data_parallel_pairs(ranks: list[list[tuple[int, torch.Tensor]]], one: list[torch.Tensor]):
    """``(got, expected)`` for every rank's every layer and round of a data-parallel case (an idle round: empty)."""
    expected = by_tokens(one)
    for rank in ranks:
        for index, (tokens, got) in enumerate(rank):
            layer = index // 4
            yield got, expected[layer, tokens] if tokens else got.new_empty((0, got.shape[1]))


@pytest.fixture(scope="module")
def every_models_layers(moe_models, tmp_path_factory) -> dict[int, dict[tuple[str, str], list]]:
    """``{size: {(model directory, case): outputs}}``: one group of processes per size, for every model."""
    tmp_path = tmp_path_factory.mktemp("layers")
    every = layer_outputs(sorted(moe_models.values()), tmp_path)
    every[1] = {(model, case.replace(":one-", ":")): outputs for (model, case), outputs in every[2].items()
                if ":one-" in case}
    return every


@pytest.fixture
def layers(moe_model, every_models_layers) -> dict[int, dict[str, list]]:
    """``{size: {case: outputs}}`` for the module's model."""
    _, model_dir = moe_model
    return {size: {case: outputs for (model, case), outputs in cases.items() if model == model_dir}
            for size, cases in every_models_layers.items()}


@pytest.mark.slow
def test_layer_equals_one_rank_for_every_dispatcher(layers):
    """The exact all-to-all, the all-gather and the fixed-capacity all-to-all (buffers for more tokens than the
    step has, as in a padded graph), over 2 and 4 tensor-parallel ranks; and with data-parallel attention, each
    rank its own tokens (one idle), the exact and the fixed-capacity one. The fixed-capacity dispatcher ran under a
    guard that raises at any host synchronization."""
    one = layers[1]["float32:plain"]
    for size, mode in ((2, "plain"), (4, "plain"), (2, "allgather"), (2, "capacity"), (4, "capacity")):
        for got, expected in zip(layers[size][f"float32:{mode}"], one, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
    for size, mode in ((2, "dp-plain"), (2, "dp-capacity"), (4, "dp-capacity")):
        for got, expected in data_parallel_pairs(layers[size][f"float32:{mode}"], one):
            torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)


@pytest.mark.slow
def test_deepep_dispatcher_equals_one_rank_over_a_stand_in_for_its_kernels(layers):
    """DeepEP's dispatcher in normal and in low-latency mode, over 2 tensor-parallel ranks and with data-parallel
    attention (a rank idle), with ``tests/deepep_fake.py`` doing what DeepEP's kernels are documented to do: the
    layout conversions before and after them give one rank's outputs, and each mode calls only its own kernels."""
    one = layers[1]["float32:plain"]
    for mode in ("deepep-normal", "deepep-low-latency"):
        for got, expected in zip(layers[2][f"float32:{mode}"], one, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    for got, expected in data_parallel_pairs(layers[2]["float32:dp-deepep-low-latency"], one):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert layers[2]["float32:deepep-normal#calls"] == [["combine", "dispatch", "get_dispatch_layout"]] * 2
    for mode in ("deepep-low-latency", "dp-deepep-low-latency"):
        assert layers[2][f"float32:{mode}#calls"] == [["low_latency_combine", "low_latency_dispatch"]] * 2


@pytest.mark.slow
def test_batch_invariant_layer_is_bitwise_one_rank_and_the_unordered_combine_is_not(layers):
    """bfloat16: each token's experts combined in ascending id order, each weighted output rounded first, as the
    invariant kernel adds them on one rank, by the exact and by the fixed-capacity all-to-all, over tensor-parallel
    ranks and with data-parallel attention. Control: the float32 sum of the default combine differs, in both."""
    one = layers[1]["bfloat16:invariant"]
    for size in (2, 4):
        for mode in ("invariant", "invariant-capacity"):
            ep = layers[size][f"bfloat16:{mode}"]
            assert all(torch.equal(a, b) for a, b in zip(ep, one, strict=True)), f"EP={size} {mode} differs"
        dp = layers[size]["bfloat16:dp-invariant-capacity"]
        assert all(torch.equal(a, b) for a, b in data_parallel_pairs(dp, one)), f"DP={size} differs from one rank"
    for mode in ("invariant-unordered", "invariant-capacity-unordered"):
        unordered = layers[2][f"bfloat16:{mode}"]
        assert not all(torch.equal(a, b) for a, b in zip(unordered, one)), f"the control ({mode}) does not differ"


GREEDY_TOKENS = 16  # decode steps with one request alone (every rank but one combines nothing)
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=GREEDY_TOKENS, ignore_eos=True,
                        return_log_probs=True, return_routing_indices=True)
RUNS = (PROMPTS[:4], PROMPTS[4:5])  # concurrent requests, then one alone (decode steps of one token: all ranks but
# one combine nothing)


def serve(model_dir: str, size: int, device: str) -> list[list[tuple]]:
    """Each run's ``(tokens, routing, log probs)`` per request, on one engine of ``size`` ranks."""
    llm = MegatronLLM(model_dir, InferenceConfig(dtype="float32", block_size_tokens=8, device=device,
                                                 tensor_parallel_size=size, enable_expert_parallel=size > 1))
    try:
        return [[(o.generated_tokens, o.routing_indices.tolist(), o.generated_log_probs)
                 for o in llm.generate(list(prompts), GREEDY)] for prompts in RUNS]
    finally:
        llm.close()


#: ``(arch, size)`` of the engines: every family over 2 ranks, Qwen3-MoE (16 experts, 4 a rank) over 4 too. Mixtral
#: and Qwen2-MoE over 4 repeat their 2-rank engines' check (their own code paths, Mixtral's ``block_sparse_moe`` and
#: Qwen2-MoE's replicated shared expert, run at 2 already); the layer tests run all three over 4.
ENGINES = [(arch, 2) for arch in sorted(VARIANTS)] + [("qwen3_moe", 4)]


@pytest.fixture(scope="module")
def engine_runs(moe_models):
    """``engine_runs(arch, size)``: one engine per arch and size serves both runs (starting its ranks costs more than
    the runs), on the GPUs where this machine has one a rank (NCCL), else on CPU (gloo); ``engine_runs(arch, 1,
    device)``: one rank on the device a size ran on, the baseline it is compared with. Each served once."""
    cache: dict = {}

    def get(arch: str, size: int, device: str | None = None) -> list[list[tuple]]:
        key = (arch, size, device or tensor_parallel_device(size))
        if key not in cache:
            cache[key] = serve(moe_models[arch], size, key[2])
        return cache[key]

    return get


@pytest.fixture(scope="module")
def hf_reference(moe_models):
    """``hf_reference(arch)``: ``transformers``' greedy tokens and routing of each prompt of the runs alone."""
    cache: dict = {}

    def get(arch: str) -> list[tuple[list[int], np.ndarray]]:
        if arch not in cache:
            model_dir = moe_models[arch]
            hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            tokenizer = Tokenizer.from_pretrained(model_dir)
            cache[arch] = [hf_greedy_with_routing(hf, tokenizer.encode(prompt), GREEDY_TOKENS)
                           for prompt in RUNS[0] + RUNS[1]]
        return cache[arch]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("arch, size", ENGINES)
def test_engine_equals_one_rank_together_and_alone(engine_runs, arch, size):
    expected = engine_runs(arch, 1, tensor_parallel_device(size))
    for run, expected_run in zip(engine_runs(arch, size), expected, strict=True):
        for (tokens, routing, log_probs), (tokens_1, routing_1, log_probs_1) in zip(run, expected_run, strict=True):
            assert tokens == tokens_1 and routing == routing_1
            assert log_probs == pytest.approx(log_probs_1, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("arch, size", ENGINES)
def test_engine_equals_transformers(engine_runs, hf_reference, arch, size):
    runs = engine_runs(arch, size)
    for (tokens, routing, _), (expected_tokens, expected_routing) in zip(runs[0] + runs[1], hf_reference(arch),
                                                                         strict=True):
        assert tokens == expected_tokens
        np.testing.assert_array_equal(np.array(routing), expected_routing)


def test_experts_that_do_not_split_over_the_ranks_are_refused(moe_model):
    _, model_dir = moe_model
    config = load_model(model_dir, torch.float32, "meta").config
    six = dataclasses.replace(config, moe=dataclasses.replace(config.moe, num_experts=6))
    with pytest.raises(ValueError, match="6 experts do not split over 4 expert-parallel ranks"):
        build_model(six, torch.float32, "meta", TensorParallel(0, 4, expert_parallel=True))


def test_the_flag_and_the_keyword_reach_the_config_and_bad_values_are_named():
    from megatron_serve.client.vllm_args import parse_llm_keywords  # noqa: PLC0415
    from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args  # noqa: PLC0415
    from megatron_serve.fleet.argv import inference_config_to_argv  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    config = InferenceConfig(enable_expert_parallel=True, device="cpu")
    assert "--enable-expert-parallel" in inference_config_to_argv(config)  # as run starts its engines
    assert inference_config_from_args(parser.parse_args(inference_config_to_argv(config))).enable_expert_parallel
    assert not inference_config_from_args(parser.parse_args([])).enable_expert_parallel
    assert parse_llm_keywords({"enable_expert_parallel": True}).config == {"enable_expert_parallel": True}
    with pytest.raises(ValueError, match="enable_expert_parallel='yes': must be True or False"):
        parse_llm_keywords({"enable_expert_parallel": "yes"})
    with pytest.raises(ValueError, match="enable_expert_parallel must be true or false, got 'yes'"):
        InferenceConfig(enable_expert_parallel="yes")


def test_gathered_row_layers_hold_rows_of_the_whole_weight_and_probe_their_column_splits(moe_model, monkeypatch,
                                                                                        caplog):
    """``gathered_rows`` (``--batch-invariant`` under EP): ``o_proj`` and the dense layers' ``down_proj`` hold their
    rank's output rows of the whole weight (not input columns of every row), loaded from the checkpoint as such; the
    CPU probe is asked about every column split a rank computes where one rank computes the whole, and where it
    finds one that rounds otherwise the mode's start says so."""
    from megatron_kernels import invariant_probe  # noqa: PLC0415

    from megatron_serve.model.layers import GatheredRowLinear, RowParallelLinear  # noqa: PLC0415

    _, model_dir = moe_model
    full = load_model(model_dir, torch.float32, "cpu")
    tp = TensorParallel(1, 2, expert_parallel=True, gathered_rows=True)
    model = build_model(full.config, torch.float32, "cpu", tp)
    load_weights(model, iterate_checkpoint(model_dir))
    rows = [name for name, m in model.named_modules() if isinstance(m, GatheredRowLinear)]
    assert rows and all(name.endswith(("o_proj", "down_proj")) and ".experts" not in name for name in rows)
    assert not any(isinstance(m, RowParallelLinear) and m.tp.size > 1 for m in model.modules())  # (a shared
    # expert's is whole on every rank)
    for name in rows:
        whole = full.get_submodule(name).weight
        half = whole.shape[0] // 2
        assert torch.equal(model.get_submodule(name).weight, whole[half:]), name
    asked = []
    monkeypatch.setattr(invariant_probe, "column_split_problems", lambda splits: asked.extend(splits) or [])
    assert model.column_split_problems() == []
    hidden, heads = full.config.hidden_size, full.config.num_heads * full.config.head_dim
    assert ((hidden, heads), torch.float32, (hidden // 2, hidden // 2)) in asked  # o_proj
    assert ((full.config.vocab_size, hidden), torch.float32, (full.config.vocab_size // 2,) * 2) in asked  # LM head
    monkeypatch.setattr(invariant_probe, "column_split_problems", lambda splits: ["a linear (64, 64): rounds"])
    with caplog.at_level("WARNING", logger="megatron_serve.model.llama"):
        model.use_batch_invariant_ops()
    assert "not one rank's in the last bits on this CPU: a linear (64, 64): rounds" in caplog.text
