"""``--batch-invariant`` with LoRA adapters: an adapter row's tokens and log probs are bitwise the same alone
and among other rows of the same and of other adapters and of the base model, dense and MoE (expert LoRA);
without the mode the batch changes them (the control: the test can fail)."""

from __future__ import annotations

import pytest

from megatron_serve import InferenceConfig, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine

from ..lora_adapters import make_peft_adapter
from .runs import TARGET_TOKENS, other_requests, target_among

EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory) -> dict[str, dict[str, str]]:
    """Per model: ``a`` (every projection; qwen3_moe: attention and the experts) and ``b`` (attention only)."""
    root = tmp_path_factory.mktemp("invariant-adapters")
    out = {}
    for arch in ("llama", "qwen3_moe"):
        moe = arch == "qwen3_moe"
        out[arch] = {
            "a": str(make_peft_adapter(models[arch], root / arch / "a", rank=8, seed=1,
                                       targets=["q_proj", "k_proj", "v_proj", "o_proj"] if moe else None,
                                       parameters=EXPERT_PARAMETERS if moe else None)),
            "b": str(make_peft_adapter(models[arch], root / arch / "b", rank=4, seed=2,
                                       targets=["q_proj", "v_proj"])),
        }
    return out


def _target(others: int, model_dir: str, adapters: dict[str, str], invariant: bool) -> tuple[list[int], list[float]]:
    """The target (adapter ``a``, greedy) with ``others`` requests around it: a third on ``a``, a third on ``b``,
    a third on the base model."""
    config = InferenceConfig(dtype="float32", block_size_tokens=16, batch_invariant=invariant, enable_lora=True,
                             max_loras=2, max_lora_rank=8, lora_modules=adapters, max_batch_tokens=512)
    engine = DynamicInferenceEngine.from_model_dir(model_dir, config)
    try:
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=TARGET_TOKENS, ignore_eos=True,
                                return_log_probs=True, lora_name="a")
        return target_among(engine, params, other_requests(others, ("a", "b", None)))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_an_adapter_row_is_bitwise_the_same_alone_and_in_a_mixed_batch(models, adapters, arch):
    alone = _target(0, models[arch], adapters[arch], invariant=True)
    for others in (7, 31):
        assert _target(others, models[arch], adapters[arch], invariant=True) == alone, f"{arch}, {others} others"


def test_without_the_mode_a_mixed_batch_changes_an_adapter_rows_log_probs(models, adapters):
    alone = _target(0, models["llama"], adapters["llama"], invariant=False)
    batched = _target(31, models["llama"], adapters["llama"], invariant=False)
    assert alone[1] != batched[1], "control: without --batch-invariant the batch changes float32 log probs"
