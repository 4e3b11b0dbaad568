"""``--batch-invariant`` with CUDA graphs (GPU only: skipped, never passed, on CPU).

On CUDA the mode's attention is ``triton_invariant_attention``, which reads the step's lengths on the
device, so dense models capture decode graphs (padded batch sizes) and piecewise mixed graphs in the mode.
A target request's tokens and log probs must be ``==`` between the graphed and the eager engine, alone and
among others (whose decode batches shrink through the padded sizes). MoE models stay eager in the mode
(the invariant expert loop reads its row counts on the host).
"""

from __future__ import annotations

import pytest
import torch

from megatron_serve import InferenceConfig
from megatron_serve.engine.core import DynamicInferenceEngine

from .runs import other_requests, target_among, target_params

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _target(model_dir: str, dtype: str, graphs: bool, others: int, sampled: bool) -> tuple[list[int], list[float]]:
    config = InferenceConfig(dtype=dtype, device="cuda", batch_invariant=True, block_size_tokens=16,
                             enable_cuda_graphs=graphs, max_requests=16)
    engine = DynamicInferenceEngine.from_model_dir(model_dir, config)
    try:
        captured = engine.worker.runner.graphs is not None and engine.worker.runner.graphs.decode.captured
        assert captured == graphs, f"graphs captured: {captured}, wanted {graphs}"
        return target_among(engine, target_params(sampled), other_requests(others))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graphs_and_eager_give_the_same_bits_in_the_mode(models, dtype):
    eager = _target(models["llama"], dtype, False, 0, sampled=False)
    for others, sampled in ((0, False), (7, False), (7, True)):
        want = eager if not sampled else _target(models["llama"], dtype, False, 0, sampled=True)
        assert _target(models["llama"], dtype, True, others, sampled) == want, f"{others} others, sampled {sampled}"


def test_moe_models_stay_eager_in_the_mode(models):
    config = InferenceConfig(dtype="bfloat16", device="cuda", batch_invariant=True, block_size_tokens=16)
    engine = DynamicInferenceEngine.from_model_dir(models["qwen3_moe"], config)
    try:
        assert engine.worker.runner.graphs is None
    finally:
        engine.shutdown()
