"""The dispatcher picks a backend per device and honours ``MEGATRON_KERNELS``; the engine's greedy
output is the same through every backend."""

from __future__ import annotations

import pytest
import torch

from megatron_kernels import OP_NAMES, backend_for, cpu_attention, cpu_rows, get_op, reference
from megatron_kernels import triton_ops


def test_every_op_has_both_implementations():
    for name in OP_NAMES:
        assert callable(getattr(reference, name)), name
        assert callable(getattr(triton_ops, name)), name


def test_default_backend_follows_device(monkeypatch):
    monkeypatch.delenv("MEGATRON_KERNELS", raising=False)
    assert backend_for("cpu") == "cpu"  # the CPU's own kernels where it has one, the reference for the rest
    assert get_op("rms_norm", "cpu") is cpu_rows.rms_norm
    assert get_op("write_kv_cache", "cpu") is reference.write_kv_cache
    assert get_op("paged_attention_decode", "cpu") is cpu_attention.paged_attention_decode
    if torch.cuda.is_available():
        assert backend_for("cuda") == "triton"
        assert get_op("rms_norm", "cuda") is triton_ops.rms_norm


@pytest.mark.parametrize("value", ["triton", "TRITON", " triton "])
def test_env_forces_triton(monkeypatch, value):
    monkeypatch.setenv("MEGATRON_KERNELS", value)
    for name in OP_NAMES:
        assert get_op(name, "cpu") is getattr(triton_ops, name)


def test_env_forces_reference(monkeypatch):
    monkeypatch.setenv("MEGATRON_KERNELS", "reference")
    for device in ("cpu", "cuda"):
        assert backend_for(device) == "reference"
        for name in OP_NAMES:
            assert get_op(name, device) is getattr(reference, name)


def test_env_forces_the_cpu_kernels(monkeypatch):
    monkeypatch.setenv("MEGATRON_KERNELS", "cpu")
    assert backend_for("cuda") == "cpu"
    assert get_op("paged_attention_decode", "cpu") is cpu_attention.paged_attention_decode
    assert get_op("paged_attention_prefill", "cpu") is cpu_attention.paged_attention_prefill
    assert get_op("fused_moe", "cpu") is reference.fused_moe  # no CPU kernel of its own


def test_bad_env_value_raises(monkeypatch):
    monkeypatch.setenv("MEGATRON_KERNELS", "cudnn")
    with pytest.raises(ValueError, match="MEGATRON_KERNELS"):
        get_op("rms_norm", "cpu")


def test_unknown_op_raises():
    with pytest.raises(KeyError):
        get_op("flash_attention", "cpu")


def test_engine_greedy_output_same_on_both_backends(monkeypatch, tmp_path):
    """The whole engine (prefill chunks, decode, KV writes) through forced Triton equals the reference."""
    import megatron_serve as serve
    from megatron_serve.model.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny", seed=3, arch="llama")
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17"]
    params = serve.SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
    generated = {}
    for backend in ("reference", "cpu", "triton"):
        monkeypatch.setenv("MEGATRON_KERNELS", backend)
        llm = serve.MegatronLLM(str(model_dir), serve.InferenceConfig(dtype="float32", block_size_tokens=16))
        layer = llm.engine.model.model.layers[0]
        expected_op = {"triton": triton_ops, "cpu": cpu_rows, "reference": reference}[backend].silu_and_mul
        assert layer.mlp.silu_and_mul is expected_op
        generated[backend] = [out.generated_tokens for out in llm.generate(prompts, params)]
    assert generated["triton"] == generated["reference"] == generated["cpu"]
    assert all(len(tokens) == 6 for tokens in generated["triton"])


def test_decode_graph_replay_through_triton_equals_the_reference_engine(monkeypatch, tmp_path):
    """Padded graph batches through the Triton kernels (padding rows: slot -1, context 0) change no token."""
    import megatron_serve as serve
    from megatron_serve.model.tiny import make_tiny_model

    from ..graph_replay import install_graphs

    model_dir = make_tiny_model(tmp_path / "tiny", seed=3, arch="llama")
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17"]
    params = serve.SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
    config = serve.InferenceConfig(dtype="float32", block_size_tokens=16)
    monkeypatch.setenv("MEGATRON_KERNELS", "reference")
    want = [out.generated_tokens for out in serve.MegatronLLM(str(model_dir), config).generate(prompts, params)]
    monkeypatch.setenv("MEGATRON_KERNELS", "triton")
    llm = serve.MegatronLLM(str(model_dir), config)
    capture = install_graphs(llm.engine, [4])
    assert [out.generated_tokens for out in llm.generate(prompts, params)] == want
    assert capture.replayed_sizes == [4] * (params.num_tokens_to_generate - 1)  # 3 rows padded to 4


def test_moe_engine_through_triton_equals_the_reference_engine(monkeypatch, tmp_path):
    """A Qwen2-MoE engine (routed experts through the grouped GEMM kernel, shared expert through the dense
    ops) decodes the same tokens and records the same routing with either backend."""
    import megatron_serve as serve
    from megatron_serve.model.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "moe", seed=3, arch="qwen2_moe")
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog."]
    params = serve.SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True,
                                  return_routing_indices=True)
    generated = {}
    for backend in ("reference", "cpu", "triton"):
        monkeypatch.setenv("MEGATRON_KERNELS", backend)
        llm = serve.MegatronLLM(str(model_dir), serve.InferenceConfig(dtype="float32", block_size_tokens=16))
        experts = llm.engine.model.model.layers[0].mlp.experts
        assert experts._fused_moe is (triton_ops.fused_moe if backend == "triton" else reference.fused_moe)
        generated[backend] = [(out.generated_tokens, out.routing_indices.tolist())
                              for out in llm.generate(prompts, params)]
    assert generated["triton"] == generated["reference"] == generated["cpu"]
