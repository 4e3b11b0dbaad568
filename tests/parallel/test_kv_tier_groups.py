"""The host KV tier (``--kv-offloading-size``) in an engine group, on CPU over gloo: under tensor parallelism each
rank holds its heads of a block, under pipeline parallelism each stage its layers' part, and a block that leaves the
device pool or comes back moves on every rank (engine/group/kv_tier.py). A working set larger than the pool comes
back from the host tier with the tokens and log probs of its first computation (``==``). The control: rank 0 copying
alone (its other ranks never told), the blocks that come back hold stale parts on the other ranks, and the log probs
differ. A disk tier behind a group is refused, naming it. On a machine with a GPU a rank the groups run there (NCCL,
the copies on a side stream: ``benchmarks/gpu_session.sh kvtiers``)."""

from __future__ import annotations

import random

import pytest

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.engine.group.leader import TensorParallelRunner
from megatron_serve.engine.runner import ModelRunner
from megatron_serve.model.tiny import make_tiny_model

from ..devices import tensor_parallel_device

pytestmark = pytest.mark.timeout(300)

BLOCK = 16
POOL = 24  # blocks: room for two of the prompts below at a time, not all six
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True, return_log_probs=True)
LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tier-group"), seed=5, num_layers=2, num_heads=4,
                               num_kv_heads=2))


def prompts(count: int = 6, length: int = 5 * BLOCK + 3) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, 500) for _ in range(length)] for _ in range(count)]


def two_passes(model_dir: str, layout: dict) -> tuple[list, list, int]:
    """Each prompt alone, twice: the second pass finds most prefixes in the host tier only (the pool holds two)."""
    device = tensor_parallel_device(layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1))
    config = InferenceConfig(block_size_tokens=BLOCK, num_kv_blocks=POOL, max_requests=2, max_batch_tokens=256,
                             kv_offloading_size=0.01, batch_invariant=True, device=device, **layout)
    with MegatronLLM(model_dir, config) as llm:
        passes = [[llm.generate([p], PARAMS)[0] for p in prompts()] for _ in range(2)]
        host_tokens = llm.engine.scheduler.host_cached_tokens
    first, second = ([(o.generated_tokens, o.generated_log_probs) for o in outs] for outs in passes)
    return first, second, host_tokens


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_a_working_set_larger_than_the_pool_comes_back_from_the_host_tier_on_every_rank(model, layout):
    first, second, host_tokens = two_passes(model, layout)
    assert host_tokens >= 4 * 5 * BLOCK  # most prefixes came back from the host tier, not recomputed
    assert second == first


def test_the_control_rank_zero_copying_alone_serves_stale_parts(model, monkeypatch):
    monkeypatch.setattr(TensorParallelRunner, "kv_copier", ModelRunner.kv_copier)  # the followers never told
    first, second, host_tokens = two_passes(model, LAYOUTS["tp2"])
    assert host_tokens >= 4 * 5 * BLOCK
    assert [log_probs for _, log_probs in second] != [log_probs for _, log_probs in first]


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_a_disk_tier_behind_a_group_is_refused_by_name(layout, tmp_path):
    with pytest.raises(ValueError, match="kv_offloading_backend 'disk' is not implemented with tensor or pipeline"):
        InferenceConfig(kv_offloading_size=1, kv_offloading_backend="disk", kv_disk_dir=str(tmp_path),
                        kv_disk_size=1, **layout)
