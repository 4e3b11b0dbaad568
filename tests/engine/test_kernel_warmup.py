"""The start-up sweep compiles every kernel variant a step can meet: nothing compiles mid-serving.

On CPU the Triton interpreter runs the kernels and ``tests.jit_variants`` records each launch's variant
key (what a GPU compiles one binary for); on a GPU Triton's own compile hook counts real compiles.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from megatron_kernels.triton_decode_attention import split_count
from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.engine.precompile.warmup import compile_kernels, warmup_shapes
from megatron_serve.model.tiny import make_tiny_model

from ..jit_variants import recorded_variants
from ..prompts import PROMPTS
from ..triton_interpreter import install

install()  # the interpreted kernels' jit helpers without a language re-patch per call


@pytest.mark.parametrize("sms, kv_heads, block_size", [(132, 8, 64), (78, 2, 16), (114, 1, 64), (16, 4, 16)])
@pytest.mark.parametrize("max_requests, max_blocks", [(1, 8), (8, 64), (256, 128), (64, 512)])
def test_the_sweep_meets_every_decode_split_count(sms, kv_heads, block_size, max_requests, max_blocks):
    def splits(batch: int, blocks: int) -> int:
        return split_count(batch, kv_heads, blocks * block_size, 64, sms)

    every = {splits(b, w) for b in range(1, max_requests + 1) for w in range(1, max_blocks + 1)}
    swept = {splits(count, blocks) for kind, count, blocks in
             warmup_shapes(8192, max_requests, max_blocks, block_size) if kind == "decode"}
    assert every <= swept


def serve_varied(llm: MegatronLLM) -> None:
    """Prefill chunks of many sizes, decode batches growing and shrinking, contexts up to the limit."""
    engine, ids = llm.engine, itertools.count()
    jobs = [(PROMPTS[i % len(PROMPTS)] * (1 + i % 3), 4 + 5 * (i % 4)) for i in range(9)]
    pending = list(jobs)
    while pending or engine.has_unfinished_requests():
        if pending:
            prompt, tokens = pending.pop()
            params = SamplingParams(temperature=0.0, num_tokens_to_generate=tokens, ignore_eos=True)
            engine.add_request(DynamicInferenceRequest(f"w{next(ids)}", prompt, llm.tokenizer.encode(prompt), params))
        engine.step()


# qwen2_moe only: serving it launches every kernel serving llama does (decode, prefill, rms_norm, rotary,
# silu_and_mul) plus the MoE grouped GEMM; the llama case (17 CPU-s under the interpreter) was dropped.
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="records the Triton interpreter's launches (on a GPU the next test counts real compiles)")
@pytest.mark.parametrize("arch", ["qwen2_moe"])
def test_serving_meets_no_kernel_variant_the_sweep_missed(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_KERNELS", "triton")
    # one layer: every layer launches the same kernel variants (the same sets with two, checked), at half the cost
    model_dir = str(make_tiny_model(tmp_path / arch, seed=5, arch=arch, num_layers=1))
    llm = MegatronLLM(model_dir, InferenceConfig(device="cpu", dtype="float32", block_size_tokens=8,
                                                 max_batch_tokens=48, max_requests=6, max_sequence_length=96,
                                                 num_kv_blocks=40))
    engine = llm.engine
    with recorded_variants() as swept:
        compile_kernels(engine.worker.runner.run_plan, engine.worker.runner.buffers, engine.kv_cache.layer_caches, 8)
    with recorded_variants() as served:
        serve_varied(llm)
    assert served, "serving launched no Triton kernel"
    assert served <= swept, f"variants first met while serving: {sorted(served - swept)}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts real Triton compiles: needs a CUDA GPU")
def test_no_triton_compile_after_start_up_on_a_gpu(tiny_llama):
    import triton  # noqa: PLC0415

    llm = MegatronLLM(tiny_llama, InferenceConfig(device="cuda", dtype="bfloat16"))
    compiles: list[str] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled, **_) -> bool:  # noqa: A002
        if not already_compiled:
            compiles.append(repr)
        return False

    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        serve_varied(llm)
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    assert not compiles, "compiled while serving:\n" + "\n".join(compiles)
