"""What runs on MoE models keeps working under expert parallelism (EP=2 over gloo): ``--batch-invariant`` rows
bitwise their own, with speculative verify rows changing nothing; preemption and the prefix cache; FP8 experts;
adapters on the experts (each rank holds its experts' ``A`` and ``B`` whole) and a trainer's push of one; refit."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.config import SpeculativeConfig
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.wire.request import EventType

from ..engine.test_speculative import looping, repetitive_prompts
from ..fp8_checkpoints import block_fp8_checkpoint
from ..model.test_moe import VARIANTS, run_together
from ..prompts import PROMPTS
from .test_fp8_tensor_parallel import generate as generate_fp8
from .test_lora_tensor_parallel import (MOE_JOBS, _assert_close, _run, assert_expert_rows_their_own,  # noqa: F401
                                        moe_adapters, moe_base, trainer_push)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EP2 = dict(tensor_parallel_size=2, enable_expert_parallel=True, device="cpu")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("ep-qwen3"), seed=1, num_heads=4, num_kv_heads=2,
                               **VARIANTS["qwen3_moe"]))


def test_batch_invariant_rows_are_their_own_and_speculation_changes_nothing(qwen3_moe):
    """Each request alone and in a batch: log probs ``==``; with n-gram speculation (verify rows through the
    dispatcher) the same tokens and log probs, and drafts accepted."""
    rng = random.Random(7)
    prompts = repetitive_prompts(7, 4)
    params = [looping(rng, num_tokens_to_generate=16, return_log_probs=True, return_routing_indices=True)
              for _ in prompts]
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, adaptive=False)
    results = {}
    for name, extra in (("plain", {}), ("spec", {"speculative": speculative})):
        llm = MegatronLLM(qwen3_moe, InferenceConfig(dtype="float32", block_size_tokens=8, batch_invariant=True,
                                                     **EP2, **extra))
        try:
            outs = llm.generate(prompts, params)
            batched = [(o.generated_tokens, o.generated_log_probs, o.routing_indices.tolist()) for o in outs]
            alone = [(o.generated_tokens, o.generated_log_probs, o.routing_indices.tolist())
                     for p, sp in zip(prompts, params) for o in llm.generate([p], [sp])]
            assert batched == alone, name
            results[name] = batched
            if name == "spec":
                assert llm.engine.stats.counters["spec_decode_num_accepted_tokens"] > 0
        finally:
            llm.close()
    assert results["spec"] == results["plain"]


def test_preemption_and_the_prefix_cache_change_nothing(qwen3_moe):
    """A pool of about two requests (preemptions and recompute) with the prefix cache on, against one rank."""
    def together(size: int):
        config = dict(EP2) if size == 2 else {}
        llm = MegatronLLM(qwen3_moe, InferenceConfig(dtype="float32", block_size_tokens=8, num_kv_blocks=14,
                                                     max_batch_tokens=64, enable_prefix_caching=True, **config))
        try:
            token_lists = [llm.tokenizer.encode(p) for p in PROMPTS[:6]]
            requests = run_together(llm, token_lists, [i % 2 == 0 for i in range(len(token_lists))])
            preempted = sum(any(e.type is EventType.PREEMPT for e in r.events) for r in requests)
            longest = sorted(token_lists, key=len)[-2:]  # again: the prefix cache holds their prompts' blocks
            again = run_together(llm, longest, [False, False])
            return [(r.generated_tokens, None if r.routing_indices is None else r.routing_indices.tolist())
                    for r in requests + again], preempted, sum(r.cached_tokens for r in again)
        finally:
            llm.close()

    ep, preempted, cached = together(2)
    assert preempted and cached, "the pool preempted nothing or the cache served nothing: the test tests neither"
    assert ep == together(1)[0]


def test_fp8_experts(tmp_path):
    """Block FP8 experts (16x16 blocks): each rank reads its experts' FP8 data and scales."""
    base = make_tiny_model(tmp_path / "moe", seed=5, arch="qwen2_moe", num_heads=4, num_kv_heads=2)
    model_dir = str(block_fp8_checkpoint(base, tmp_path / "fp8", (16, 16)))
    tokens_1, log_probs_1 = generate_fp8(model_dir, 1)
    tokens_2, log_probs_2 = generate_fp8(model_dir, 2, enable_expert_parallel=True)
    assert tokens_2 == tokens_1
    for row, expected in zip(log_probs_2, log_probs_1):
        assert row == pytest.approx(expected, abs=1e-4)


def test_expert_adapters_and_a_push_equal_one_rank(moe_base, moe_adapters):  # noqa: F811 - fixtures
    """Expert, dense and base rows in one batch, then a trainer's push of an expert adapter: rank 0 sends each rank
    the adapter, each keeps its experts' share; the adapted rows are recomputed where their experts are."""
    pushed = trainer_push(moe_base, moe_adapters["experts"])
    one = _run(moe_base, moe_adapters, 1, pushed, MOE_JOBS, max_cpu_loras=4)
    ep = _run(moe_base, moe_adapters, 2, pushed, MOE_JOBS, max_cpu_loras=4, enable_expert_parallel=True)
    _assert_close(ep, one)
    assert one[0][0] != one[4][0]  # control: the expert adapter changes its prompt's tokens


def test_batch_invariant_expert_adapter_rows_are_their_own(moe_base, moe_adapters):  # noqa: F811 - fixtures
    assert_expert_rows_their_own(moe_base, moe_adapters, enable_expert_parallel=True)


def test_refit_from_a_directory_and_from_a_trainers_tensors(qwen3_moe, tmp_path):
    """Each rank loads only its experts of the new weights: per-expert tensors of a directory (another rank's are
    never read), and a trainer's stacked ``experts.gate_up_proj`` (each rank copies its experts' slice)."""
    other = str(make_tiny_model(tmp_path / "b", seed=2, num_heads=4, num_kv_heads=2, **VARIANTS["qwen3_moe"]))
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True, return_routing_indices=True)

    def answers(llm: MegatronLLM):
        return [(o.generated_tokens, o.routing_indices.tolist()) for o in llm.generate(PROMPTS[:3], params)]

    with MegatronLLM(other, InferenceConfig(dtype="float32", block_size_tokens=8)) as one:
        expected = answers(one)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
    with MegatronLLM(qwen3_moe, InferenceConfig(dtype="float32", block_size_tokens=8, **EP2)) as llm:
        before = answers(llm)
        assert before != expected  # the control: the two checkpoints answer differently
        llm.engine.memory.refit(other)
        assert answers(llm) == expected
        llm.engine.memory.refit(qwen3_moe)
        assert answers(llm) == before
        llm.refit(trainer.named_parameters(), epoch=3)
        assert answers(llm) == expected
