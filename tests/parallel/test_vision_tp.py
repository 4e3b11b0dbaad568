"""Vision-language models under tensor parallelism (gloo on CPU): TP=2 equals TP=1.

Rank 0 runs the vision tower and broadcasts each step's image embeddings; the other rank holds no
tower and gets the multimodal rotary positions with the step plan. Qwen2-VL exercises both.
"""

from __future__ import annotations


import pytest

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.model.tiny import make_tiny_model

from ..devices import tensor_parallel_device
from ..images import png

GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True, return_log_probs=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.mark.slow
def test_qwen2_vl_tp2_equals_tp1(tmp_path):
    model_dir = str(make_tiny_model(tmp_path / "qwen2-vl", seed=5, arch="qwen2_vl"))
    prompts = [{"prompt": f"Look {IMAGE} here", "images": [png(84, 112, 1)]},
               {"prompt": f"{IMAGE} and {IMAGE}", "images": [png(56, 56, 2), png(140, 70, 3)]},
               "text only"]
    results = {}
    for tp in (1, 2):
        llm = MegatronLLM(model_dir, InferenceConfig(tensor_parallel_size=tp, block_size_tokens=8, device=tensor_parallel_device(2),
                                                     max_batch_tokens=16))
        try:
            results[tp] = llm.generate(prompts, GREEDY)
        finally:
            llm.close()
    assert [r.generated_tokens for r in results[2]] == [r.generated_tokens for r in results[1]]
    for two, one in zip(results[2], results[1]):
        assert two.generated_log_probs == pytest.approx(one.generated_log_probs, abs=1e-4)
