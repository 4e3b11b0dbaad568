"""``--all2all-backend``: the flag and the keyword reach the config, bad values and impossible combinations are
refused by name, ``auto`` takes DeepEP only where it can run (each reason it cannot, said in the start-up line),
and the pieces of the dispatchers that need no peer: DeepEP's layout conversions, the graphs' padded sizes.

``deep_ep`` cannot be imported here (it needs GPUs): the resolution is given an importer that returns a stand-in
module or raises, as ``importlib`` does. The dispatchers themselves run over gloo in ``test_expert_parallel.py``."""

from __future__ import annotations

import argparse
import contextlib
import os
import types

import pytest
import torch
import torch.distributed as dist

from megatron_serve import InferenceConfig
from megatron_serve.client import vllm_options
from megatron_serve.client.vllm_args import parse_llm_keywords
from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args
from megatron_serve.config import ALL2ALL_BACKENDS
from megatron_serve.engine.experts.backend import (agree_on_backend, install_expert_backend, rank_tokens,
                                                   resolve_backend)
from megatron_serve.engine.precompile.graphs import DecodeGraphs, MixedGraphs, StepGraphs
from megatron_serve.engine.sizing import engine_buffers
from megatron_serve.fleet.argv import inference_config_to_argv
from megatron_serve.model.experts import dispatch as expert_dispatch
from megatron_serve.model.experts.deepep_dispatcher import low_latency_rows, normal_pairs, normal_sum
from megatron_serve.model.experts.dispatch import StepDispatcher
from megatron_serve.model.loader import build_model, load_model
from megatron_serve.model.parallel import TensorParallel
from megatron_serve.model.tiny import make_tiny_model

from .. import deepep_fake
from ..forked import forked_reports, report
from ..helpers import hosted_rendezvous
from ..host_sync import HostSync, NoHostSync

CUDA = torch.device("cuda")  # only its type is read: nothing runs on it


def fake_deep_ep() -> types.ModuleType:
    return deepep_fake  # type: ignore[return-value]


def not_installed() -> types.ModuleType:
    raise ModuleNotFoundError("No module named 'deep_ep'")


def test_the_flag_and_the_keyword_reach_the_config_and_bad_values_are_named():
    assert ALL2ALL_BACKENDS == vllm_options.ALL2ALL_BACKENDS == ("auto", *expert_dispatch.BACKENDS)
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert inference_config_from_args(parser.parse_args([])).all2all_backend == "auto"
    config = inference_config_from_args(parser.parse_args(["--all2all-backend", "alltoall"]))
    assert config.all2all_backend == "alltoall"
    assert inference_config_from_args(parser.parse_args(inference_config_to_argv(config))).all2all_backend == "alltoall"
    with pytest.raises(SystemExit):
        parser.parse_args(["--all2all-backend", "pplx"])
    assert parse_llm_keywords({"all2all_backend": "allgather_reducescatter"}).config == {
        "all2all_backend": "allgather_reducescatter"}
    with pytest.raises(ValueError, match="all2all_backend='naive': not supported by this build"):
        parse_llm_keywords({"all2all_backend": "naive"})


def test_impossible_combinations_are_refused_by_name():
    with pytest.raises(ValueError, match="all2all_backend must be one of auto, alltoall, .*got 'pplx'"):
        InferenceConfig(device="cpu", all2all_backend="pplx")
    with pytest.raises(ValueError, match="allgather_reducescatter is not implemented under data-parallel attention"):
        InferenceConfig(device="cpu", all2all_backend="allgather_reducescatter", data_parallel_size=2,
                        enable_expert_parallel=True)
    with pytest.raises(ValueError, match="deepep_low_latency: DeepEP's kernels run on GPUs, not on cpu"):
        InferenceConfig(device="cpu", all2all_backend="deepep_low_latency")
    with pytest.raises(ValueError, match="deepep_high_throughput cannot give batch_invariant's one-rank bits"):
        InferenceConfig(device="cuda", all2all_backend="deepep_high_throughput", batch_invariant=True)


def resolve(importer=fake_deep_ep, device=CUDA, dtype=torch.bfloat16, hidden=2048, ranks=2, **config):
    return resolve_backend(InferenceConfig(**{"device": "cuda", **config}), device, dtype, hidden, ranks, importer)


def test_auto_takes_deepep_where_it_runs_and_says_why_not_elsewhere():
    assert resolve() == ("deepep_low_latency", "auto: deep_ep imports on this GPU")
    for why, kwargs in [
        ("its kernels run on GPUs, not on cpu", dict(device=torch.device("cpu"))),
        ("deep_ep is not importable (ModuleNotFoundError: No module named 'deep_ep')", dict(importer=not_installed)),
        ("DeepEP adds a token's experts in its own order", dict(batch_invariant=True)),
        ("LoRA adapters on the experts", dict(enable_lora=True)),
        ("the model runs in float32", dict(dtype=torch.float32)),
        ("built for hidden sizes 2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192, not 256", dict(hidden=256)),
        ("DeepEP has no configuration for 3 ranks", dict(ranks=3)),
    ]:
        backend, reason = resolve(**kwargs)
        assert backend == "alltoall" and why in reason, (kwargs, reason)
    assert resolve(all2all_backend="alltoall") == ("alltoall", "--all2all-backend")


def test_a_deepep_backend_named_that_cannot_run_is_refused_at_start():
    assert resolve(all2all_backend="deepep_high_throughput", hidden=256)[0] == "deepep_high_throughput"  # any hidden
    with pytest.raises(ValueError, match=r"--all2all-backend deepep_low_latency: deep_ep is not importable"):
        resolve(all2all_backend="deepep_low_latency", importer=not_installed)
    with pytest.raises(ValueError, match=r"deepep_low_latency: its low-latency kernels are built for hidden sizes"):
        resolve(all2all_backend="deepep_low_latency", hidden=256)


def test_each_rank_installs_the_backend_and_rank_zero_says_which(tmp_path, caplog):
    path = make_tiny_model(tmp_path / "moe", seed=3, arch="qwen3_moe", num_heads=4, num_kv_heads=2)
    config = load_model(str(path), torch.float32, "meta").config
    one = build_model(config, torch.float32, "cpu")
    assert install_expert_backend(one, InferenceConfig(device="cpu")) is None and one.expert_step is None
    for rank in (0, 1):
        model = build_model(config, torch.float32, "cpu", TensorParallel(rank, 2, expert_parallel=True))
        with caplog.at_level("INFO", logger="megatron_serve.engine.experts.backend"):
            step = install_expert_backend(model, InferenceConfig(device="cpu"))
        blocks = [m.mlp for m in model.model.layers if m.sparse]
        assert step is model.expert_step and all(isinstance(b.dispatcher, StepDispatcher) for b in blocks)
        assert all(b.dispatcher.step is step and b.dispatcher.capacity is not None for b in blocks)
    assert caplog.text.count("all-to-all backend") == 1  # one line, from expert rank 0
    assert "expert parallelism over 2 ranks: all-to-all backend alltoall (auto: no DeepEP, its kernels run on " \
           "GPUs, not on cpu)" in caplog.text


def test_deepep_low_latency_slabs_become_rows_without_a_host_sync():
    packed = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    with NoHostSync():
        rows, ids = low_latency_rows(packed, torch.tensor([3, 0], dtype=torch.int32))
    assert torch.equal(rows, packed.view(8, 3)) and ids.view(-1).tolist() == [0, 0, 0, -1, -1, -1, -1, -1]
    with pytest.raises(HostSync):  # the guard's control: the normal mode's expansion does read on the host
        with NoHostSync():
            normal_pairs(torch.tensor([[1, -1], [-1, 0]]))


def test_deepep_normal_mode_expands_received_tokens_and_sums_their_weighted_rows():
    received_ids = torch.tensor([[1, -1], [-1, -1], [0, 1]])  # token 1 came for another rank's experts only
    tokens, slots = normal_pairs(received_ids)
    assert tokens.tolist() == [0, 2, 2] and slots.tolist() == [0, 0, 1]
    outputs = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    weights = torch.tensor([0.5, 0.25, 0.75])
    assert normal_sum(outputs, weights, tokens, 3).tolist() == [[0.5, 1.0], [0.0, 0.0], [4.5, 5.5]]


def test_data_parallel_steps_pad_to_one_size_whatever_each_rank_runs(tmp_path):
    """Every rank computes the group's padded size from the configured sizes, captured or not: decode and mixed
    sizes together; a step above them all runs eagerly (None)."""
    path = make_tiny_model(tmp_path / "m", seed=3, arch="qwen3_moe", num_heads=4, num_kv_heads=2)
    model = load_model(str(path), torch.float32, "cpu")
    config = InferenceConfig(device="cpu", max_requests=6, cuda_graph_sizes=[1, 2, 4, 16])
    buffers = engine_buffers(config, 64, torch.device("cpu"))
    graphs = StepGraphs(DecodeGraphs(model, [1, 2, 4, 6], buffers, lambda: None),
                        MixedGraphs(model, [1, 2, 4, 16], buffers), lambda: None, torch.device("cpu"))
    assert [graphs.padded_size(n) for n in (0, 1, 3, 5, 6, 7, 16, 17)] == [1, 1, 4, 6, 6, 16, 16, None]


def test_low_latency_buffers_hold_a_ranks_chunk_in_multiples_of_four():
    assert [rank_tokens(limit, tp) for limit, tp in ((512, 1), (512, 8), (1, 1), (100, 3))] == [512, 64, 4, 36]


def agree(group: int, meeting: dict[str, str], rank: int, backend: str) -> None:
    """A rank of ``group``: it meets the group's other rank at ``meeting`` (torchrun's environment, the store hosted
    by the test) and reports the backend it agreed on, and why."""
    os.environ.update(meeting, RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo")
    report(group, rank, *agree_on_backend(backend, "auto: here", None, torch.device("cpu")))
    dist.destroy_process_group()


def test_auto_comes_to_one_backend_on_every_rank_of_a_group():
    """Issue 65: each rank resolved ``auto`` alone, so a rank where deep_ep imports beside one where it cannot would
    pick different backends and wait in dispatches the other never joins. Two real processes over gloo: one able,
    one not: both run alltoall; both able: both keep DeepEP."""
    groups = [(("deepep_low_latency", "alltoall"), "alltoall"),
              (("deepep_low_latency", "deepep_low_latency"), "deepep_low_latency")]
    with contextlib.ExitStack() as stores:  # each group meets at a store of its own, hosted here
        meetings = [stores.enter_context(hosted_rendezvous(2)) for _ in groups]
        # every rank a child forked from this process, which has imported torch
        failed, said = forked_reports(agree, [(g, meeting, r, b) for g, (meeting, (backends, _)) in
                                              enumerate(zip(meetings, groups)) for r, b in enumerate(backends)])
    assert failed == 0
    outs = {(int(group), int(rank)): rest for group, rank, *rest in said}
    for index, (_, agreed) in enumerate(groups):
        assert [outs[index, rank][0] for rank in range(2)] == [agreed, agreed], outs
        if agreed == "alltoall":
            assert outs[index, 0][1] == "auto: another rank of the group cannot run DeepEP (auto: here here)"
