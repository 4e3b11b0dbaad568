"""EPLB over an expert-parallel engine of 4 ranks (real processes over gloo) whose router favours two experts: the
balancedness measured before the rearrangement is low, the one measured after it at least 0.9; the rearrangement runs
while requests decode and every request completes; under ``--batch-invariant`` the tokens and log probs are ``==``
before and after it and ``==`` one rank's, and the routing indices (logical expert ids) are one rank's. Qwen3-MoE
(16 experts, top 4, 4 copies more). Block-FP8 experts move with their scales: over 2 ranks, the answers after the
moves are ``==`` the group's without EPLB."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.model.tiny import make_tiny_model

from ..fp8_checkpoints import block_fp8_checkpoint
from ..model.test_moe import VARIANTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HOT = (3, 5)
PROMPTS = [f"Expert parallel {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=20, ignore_eos=True, return_log_probs=True,
                        return_routing_indices=True)
#: a rearrangement every 12 steps, from the last 12: the first comes while the first run decodes, the second
#: (which measures the placement the first made) while the second run does
EPLB = {"window_size": 12, "step_interval": 12, "num_redundant_experts": 4}


def skewed_model(path, arch: str) -> str:
    """A tiny MoE whose routers favour experts 3 and 5: every token's embedding gets a constant first feature, which
    only those experts' router rows read."""
    model_dir = make_tiny_model(path, seed=1, num_heads=4, num_kv_heads=2, **VARIANTS[arch])
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.embed_tokens.weight"][:, 0] = 1.0
    for name, tensor in tensors.items():
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            tensor[:, 0] = 0.0
            tensor[list(HOT), 0] = 0.3
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    return str(model_dir)


def answers(llm: MegatronLLM) -> list[tuple]:
    return [(o.generated_tokens, o.generated_log_probs, o.routing_indices.tolist())
            for o in llm.generate(PROMPTS, GREEDY)]


# Qwen3-MoE only: Mixtral (8 experts, top 2) ran the same rearrangement code on the engine's one MoE block type (its
# checkpoint's names are the loader's, which test_expert_parallel reads per rank), a repeat at a group's cost.
@pytest.mark.parametrize("arch", ["qwen3_moe"])
def test_rearranged_experts_even_the_load_and_change_no_bit(tmp_path, arch):
    model_dir = skewed_model(tmp_path / arch, arch)
    with MegatronLLM(model_dir, InferenceConfig(dtype="float32", block_size_tokens=8, batch_invariant=True)) as one:
        expected = answers(one)
    config = InferenceConfig(dtype="float32", block_size_tokens=8, batch_invariant=True, device="cpu",
                             tensor_parallel_size=4, enable_expert_parallel=True, enable_eplb=True, eplb_config=EPLB)
    with MegatronLLM(model_dir, config) as llm:
        balancer = llm.engine.model.expert_balancer
        first = answers(llm)  # the first rearrangement starts at step 12, while these decode
        assert balancer.stats.layers_moved, "no layer moved during the first run: the test tests nothing"
        second = answers(llm)
        stats = balancer.stats
    assert first == expected and second == expected
    (_, before, planned), (_, after, _) = stats.history[:2]
    assert before < 0.9 and planned >= 0.9 and after >= 0.9, stats.history
    assert stats.rearrangements >= 1 and stats.moved_experts > 0


def test_fp8_experts_move_with_their_scales(tmp_path):
    """A move carries each expert's e4m3 weights and its 16x16 block scales as one byte row (gloo has no FP8): with
    the layers rearranged, tokens, log probs and routing are ``==`` the same group's without EPLB, and the tokens one
    rank's (FP8 log probs over 2 ranks differ from one rank's in the last bits, with or without EPLB)."""
    model_dir = str(block_fp8_checkpoint(skewed_model(tmp_path / "base", "qwen3_moe"), tmp_path / "fp8", (16, 16)))
    with MegatronLLM(model_dir, InferenceConfig(block_size_tokens=8, batch_invariant=True)) as one:
        one_rank = [tokens for tokens, _, _ in answers(one)]
    ep2 = dict(block_size_tokens=8, batch_invariant=True, device="cpu", tensor_parallel_size=2,
               enable_expert_parallel=True)
    with MegatronLLM(model_dir, InferenceConfig(**ep2)) as llm:
        expected = answers(llm)
    with MegatronLLM(model_dir, InferenceConfig(**ep2, enable_eplb=True, eplb_config=EPLB)) as llm:
        experts = llm.engine.model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj_scale.shape[0] == 10
        first = answers(llm)
        moved = llm.engine.model.expert_balancer.stats.layers_moved
        second = answers(llm)
    assert moved, "no layer moved during the first run: the test tests nothing"
    assert first == expected and second == expected
    assert [tokens for tokens, _, _ in expected] == one_rank
