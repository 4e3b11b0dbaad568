"""LoRA adapters on the experts under EPLB (issue 63), over an expert-parallel engine of 2 ranks (real processes over
gloo) whose router favours two experts, in ``--batch-invariant``: requests with an expert adapter and without, in
one batch, while the layers are rearranged and after; then the adapter unloaded and loaded again and a second one
loaded, each written into a slot after the moves (the second adapts attention and the dense layer too). Tokens and log
probs ``==`` the same group's without EPLB and ``==`` one rank's: the row-parallel layers gather their input, adapters
or not, and every adapter's delta is computed whole as one rank computes it (``InferenceConfig.gathers_rows``; the
control with partial sums: tests/parallel/test_lora_gathered_rows.py). On rank 0, every replica's slot row holds the
adapter's rows of its logical expert (the rows followed the moves). Qwen3-MoE, 16 experts, top 4, 4 copies more."""

from __future__ import annotations

import pytest
import torch

from megatron_serve import InferenceConfig, SamplingParams
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.model.lora.experts import EXPERT_PROJECTIONS
from megatron_serve.model.lora.slots import _ExpertSlotWeights

from ..lora_adapters import make_peft_adapter
from ..prompts import PROMPTS, run_requests
from .test_expert_parallel_eplb import EPLB, skewed_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LATE_MODULES = ["k_proj", "o_proj"]  # attention: a column-parallel part of 16 columns a rank, a row-parallel layer
#: 20 tokens: the first rearrangement starts at step 12 and both MoE layers are swapped in by step 16
JOBS = [(PROMPTS[0], "experts"), (PROMPTS[1], None), (PROMPTS[2], "experts"), (PROMPTS[3], None)]
LATE = [(PROMPTS[0], "late"), (PROMPTS[1], "experts"), (PROMPTS[2], None), (PROMPTS[3], "late")]


def _greedy(name: str | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, num_tokens_to_generate=20, ignore_eos=True, return_log_probs=True,
                          lora_name=name)


def _answers(engine: DynamicInferenceEngine, jobs: list[tuple[str, str | None]]) -> list[tuple]:
    return [(o.generated_tokens, o.generated_log_probs) for o in run_requests(engine, [(p, _greedy(n))
                                                                                       for p, n in jobs])]


def _engine(model_dir: str, adapter: str, **parallel) -> DynamicInferenceEngine:
    config = InferenceConfig(dtype="float32", block_size_tokens=8, device="cpu", batch_invariant=True,
                             enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules={"experts": adapter},
                             **parallel)
    return DynamicInferenceEngine.from_model_dir(model_dir, config)


def _expert_targets(engine: DynamicInferenceEngine) -> list[tuple[int, _ExpertSlotWeights]]:
    """Rank 0's expert LoRA tables, by decoder layer."""
    return [(layer, t) for layer, t in engine.loras.slots._targets if isinstance(t, _ExpertSlotWeights)]


def _assert_rows_follow_the_experts(engine: DynamicInferenceEngine) -> None:
    """Each LoRA slot's rows, stack slot by stack slot, are its adapter's rows of the logical expert there."""
    loras = engine.loras
    for slot in range(loras.slots.max_loras):
        if loras.holder(slot) is None:
            continue
        adapter = loras.resident[loras.holder(slot).partition("#")[0]].adapter
        for layer, target in _expert_targets(engine):
            placed = target.experts.slots
            for projection in EXPERT_PROJECTIONS:
                a, b = adapter.weights[(layer, projection)]
                assert torch.equal(target.a[projection][slot, :, : a.shape[1]], a[placed])
                assert torch.equal(target.b[projection][slot, :, :, : a.shape[1]], b[placed])


def test_expert_adapters_follow_the_moves_and_change_no_bit(tmp_path):
    model_dir = skewed_model(tmp_path / "base", "qwen3_moe")
    adapters = {name: str(make_peft_adapter(model_dir, tmp_path / name, rank=4, seed=seed, targets=targets,
                                            parameters=EXPERTS, b_scale=8.0))
                for name, seed, targets in (("experts", 24, []), ("late", 25, LATE_MODULES))}
    results = {}
    for run, parallel in (("one", {}), ("ep", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
                           ("eplb", dict(tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                                         eplb_config=EPLB))):
        engine = _engine(model_dir, adapters["experts"], **parallel)
        try:
            placed = [list(target.experts.slots) for _, target in _expert_targets(engine)]
            mixed = _answers(engine, JOBS) + _answers(engine, JOBS)  # rearranged during the first
            if run == "eplb":  # the adapter's rows were written before the moves
                assert engine.model.expert_balancer.stats.layers_moved, "no layer moved: the test tests nothing"
                assert placed != [target.experts.slots for _, target in _expert_targets(engine)]
                _assert_rows_follow_the_experts(engine)
            engine.loras.unload("experts")
            for name in ("experts", "late"):  # each written into a slot after the moves
                engine.loras.load(name, adapters[name])
            results[run] = mixed, _answers(engine, LATE)
            if run == "eplb":
                _assert_rows_follow_the_experts(engine)
        finally:
            engine.shutdown()
    assert results["eplb"] == results["ep"] == results["one"]
    before_1, late_1 = results["one"]
    # control: each prompt runs under another adapter (or the base) in the late batch than in the first, and its
    # tokens change, so the comparisons cover both adapters' expert deltas
    assert all(first[0] != then[0] for first, then in zip(before_1, late_1))
