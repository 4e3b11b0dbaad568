"""FP8 under tensor parallelism (gloo on CPU): every rank loads its slice of the FP8 weights and scales (or
quantizes its slice of float weights, per-row scales from whole rows), each holds its KV heads in FP8, and
the outputs equal TP=1's."""

from __future__ import annotations

import pytest

from megatron_serve import InferenceConfig, MegatronLLM
from megatron_serve.model.tiny import make_tiny_model

from ..devices import tensor_parallel_device
from ..fp8_checkpoints import block_fp8_checkpoint
from .test_tensor_parallel import GREEDY, PROMPTS

DEVICE = tensor_parallel_device(2)


def generate(model_dir: str, tp: int, **config):
    llm = MegatronLLM(model_dir, InferenceConfig(tensor_parallel_size=tp, block_size_tokens=8, device=DEVICE,
                                                 kv_cache_dtype="fp8", **config))
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        return [o.generated_tokens for o in outs], [o.generated_log_probs for o in outs]
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["block-fp8-moe", "online-fp8-llama"])
def test_fp8_tp2_equals_tp1(variant, tmp_path):
    if variant == "block-fp8-moe":  # 16x16 blocks: every rank's slice of every projection holds whole blocks
        base = make_tiny_model(tmp_path / "moe", seed=5, arch="qwen2_moe", num_heads=4, num_kv_heads=2)
        model_dir, config = str(block_fp8_checkpoint(base, tmp_path / "fp8", (16, 16))), {}
    else:
        model_dir, config = str(make_tiny_model(tmp_path / "llama", seed=3)), {"quantization": "fp8"}
    tokens_1, log_probs_1 = generate(model_dir, 1, **config)
    tokens_2, log_probs_2 = generate(model_dir, 2, **config)
    assert tokens_2 == tokens_1
    for row, expected in zip(log_probs_2, log_probs_1):
        assert row == pytest.approx(expected, abs=1e-4)
