"""LoRA adapters under tensor parallelism (gloo on CPU, two real rank processes): each rank holds its share of an
adapter (model.lora_shards) and a TP=2 engine gives what TP=1 gives, for a batch mixing adapters and the base, for
an adapter pushed from trainer memory, and in batch-invariant mode (the fixed-order reduction)."""

from __future__ import annotations

import pytest
import torch

from megatron_serve import InferenceConfig, SamplingParams
from megatron_serve.client.lora_push import adapter_push
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.model.tiny import make_tiny_model

from ..lora_adapters import make_peft_adapter, peft_model
from ..prompts import PROMPTS, run_requests

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    # 4 query heads over 2 KV heads: TP=2 splits q, k and v (column-parallel B) and o_proj's inputs (row-parallel A)
    return str(make_tiny_model(tmp_path_factory.mktemp("lora-tp"), seed=3, num_heads=4, num_kv_heads=2))


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-tp-adapters")
    return {"r8": str(make_peft_adapter(base, root / "r8", rank=8, seed=8)),
            "r4": str(make_peft_adapter(base, root / "r4", rank=4, seed=4, targets=["q_proj", "v_proj", "down_proj"]))}


def _greedy(name: str | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, num_tokens_to_generate=NEW_TOKENS, ignore_eos=True, return_log_probs=True,
                          lora_name=name)


JOBS = [(PROMPTS[0], "r8"), (PROMPTS[1], None), (PROMPTS[2], "r4"), (PROMPTS[3], "r8"), (PROMPTS[0], None)]


def _run(base: str, adapters: dict[str, str], tp: int, pushed=None, **overrides):
    """Tokens and log probs of :data:`JOBS` in one batch (and of the pushed adapter's, when ``pushed`` is given)."""
    config = InferenceConfig(dtype="float32", block_size_tokens=8, device="cpu", enable_lora=True, max_loras=3,
                             max_lora_rank=8, lora_modules=adapters, tensor_parallel_size=tp, **overrides)
    engine = DynamicInferenceEngine.from_model_dir(base, config)
    try:
        outs = run_requests(engine, [(p, _greedy(n)) for p, n in JOBS])
        results = [(o.generated_tokens, o.generated_log_probs) for o in outs]
        if pushed is not None:
            named, push = pushed
            engine.loras.push(push, named, set())
            outs = run_requests(engine, [(p, _greedy(push.name)) for p in PROMPTS[:2]])
            results += [(o.generated_tokens, o.generated_log_probs) for o in outs]
        return results
    finally:
        engine.shutdown()


def _assert_close(tp2, tp1) -> None:
    for (tokens, log_probs), (tokens_1, log_probs_1) in zip(tp2, tp1, strict=True):
        assert tokens == tokens_1
        assert log_probs == pytest.approx(log_probs_1, abs=1e-4)


@pytest.mark.slow
def test_tp2_with_adapters_and_a_push_equals_tp1(base, adapters):
    trainer = peft_model(base, adapters["r8"])
    with torch.no_grad():  # the trainer's next policy: a different adapter than the directory's
        for name, param in trainer.named_parameters():
            if "lora_B" in name:
                param.mul_(-1.5)
    pushed = adapter_push("policy", trainer, version=1, rank=None, alpha=None, use_rslora=False, target_modules=None)
    tp1 = _run(base, adapters, 1, pushed)
    tp2 = _run(base, adapters, 2, pushed)
    _assert_close(tp2, tp1)
    # control: the adapters change the tokens (same prompt, r8 vs the base), so the comparison covers their deltas
    assert tp1[0][0] != tp1[4][0]
    assert tp1[5][0] != tp1[4][0]


@pytest.mark.slow
def test_tp2_batch_invariant_equals_tp1(base, adapters):
    """Batch-invariant TP=2: the row-parallel deltas join the partial sums of the fixed-order reduction. (Rows
    bitwise equal to each alone needs invariant LoRA ops in model.lora_slots, not part of the sharding.)"""
    _assert_close(_run(base, adapters, 2, batch_invariant=True), _run(base, adapters, 1, batch_invariant=True))
