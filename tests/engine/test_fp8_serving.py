"""``--quantization fp8`` on a float checkpoint and ``--kv-cache-dtype fp8``: what they serve, what they hold.

FP8 KV holds every key and value as e4m3 with a float32 scale per token and head. Its logits stay
within ``KV_LOGIT_TOLERANCE`` of the model-dtype cache's (relative to their spread) on random
prompts; prefix caching and preemption give the same tokens as without them, as for any cache; the
pool holds ``2 * head_dim / (head_dim + 4)`` times the tokens in the same memory.
"""

from __future__ import annotations

import importlib.util
import random
import re
import sys
from pathlib import Path

import pytest
import torch

from megatron_kernels import fp8
from megatron_serve import EventType, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.engine.kv.cache import KVCachePool
from megatron_serve.engine.runner import ModelRunner
from megatron_serve.engine.step_plan import StepBuffers, StepPlan
from megatron_serve.model.loader import load_model
from megatron_serve.model.tiny import make_tiny_model

from ..fp8_checkpoints import block_fp8_checkpoint, edited_checkpoint
from ..prompts import PROMPTS

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8.py"
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=16, ignore_eos=True, return_log_probs=True)
# Logit error of an FP8 cache over 2 layers, as a share of the logits' standard deviation: e4m3 keeps
# keys and values to within 2^-4 of themselves; measured up to 0.05 over these prompts.
KV_LOGIT_TOLERANCE = 0.1
AGREEMENT_FLOOR = 0.8  # measured 88% (the bf16-vs-float32 yardstick: 87%) on the benchmark's tiny model


def _generate(model_dir, prompts=PROMPTS, params=GREEDY, **config):
    llm = MegatronLLM(str(model_dir), InferenceConfig(**{"dtype": "float32", "block_size_tokens": 16, **config}))
    outs = llm.generate(prompts, params)
    return llm, [(o.generated_tokens, o.generated_log_probs) for o in outs]


def _per_row_dequantized(model_dir: Path, target: Path) -> Path:
    """``model_dir`` with every decoder projection replaced by its per-row FP8 value (float32)."""
    def per_row(tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            if name.startswith("model.layers.") and name.endswith("proj.weight"):
                tensors[name] = fp8.dequantize(*fp8.quantize(tensor, None), None, torch.float32)

    return edited_checkpoint(model_dir, target, per_row)


def test_quantization_fp8_serves_a_float_checkpoint_quantized_per_row(tmp_path, monkeypatch):
    """What ``--quantization fp8`` serves is the checkpoint quantized per row: the engine on those weights
    dequantized, bit for bit, through the reference path (dequantize, then the float GEMM) on every device.

    A GPU's Triton path is another model in arithmetic, not only in summation order: prefills of more than
    ``WEIGHT_ONLY_MAX_ROWS`` rows quantize their activations to e4m3 (W8A8), which moved these near-uniform
    log probs by up to 5e-3 and changed the greedy tokens of 3 of the 8 prompts, from the second token on
    (measured under the interpreter with ``MEGATRON_KERNELS=triton``). Its GEMMs are checked in
    tests/kernels/test_fp8_kernels.py.
    """
    monkeypatch.setenv("MEGATRON_KERNELS", "reference")  # ops are resolved when each engine's model is built
    model_dir = make_tiny_model(tmp_path / "tiny", seed=2, arch="qwen2")  # fused q/k/v with biases
    llm, quantized = _generate(model_dir, quantization="fp8")
    model = llm.engine.model
    linear_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    linear_values = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    assert linear_bytes == linear_values  # one byte per weight (float32 before)
    assert model.model.layers[0].mlp.down_proj.weight_scale.shape == (64, 1)  # a scale per output row
    _, dense = _generate(_per_row_dequantized(model_dir, tmp_path / "dequantized"))
    assert quantized == dense
    _, unquantized = _generate(model_dir)
    assert quantized != unquantized  # it did change the weights


def test_quantization_fp8_keeps_an_fp8_checkpoint_as_it_is(tmp_path):
    model_dir = block_fp8_checkpoint(make_tiny_model(tmp_path / "tiny", seed=2), tmp_path / "fp8", (16, 16))
    _, served = _generate(model_dir, quantization="fp8")
    _, plain = _generate(model_dir)
    assert served == plain


def _prefill_then_decode(model, pool: KVCachePool, prompts: list[list[int]], choices: list[list[int]]
                         ) -> list[torch.Tensor]:
    """Logits of a prefill of ``prompts`` and one decode step per entry of ``choices`` (the tokens fed)."""
    block = pool.shape[3]
    per_seq = -(-(max(map(len, prompts)) + len(choices)) // block)
    requests = len(prompts)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(requests)]
    lengths = [len(p) for p in prompts]
    buffers = StepBuffers(sum(lengths), requests, per_seq, torch.device("cpu"))
    runner = ModelRunner(model, block, torch.device("cpu"), buffers)
    out = buffers.np
    tokens = [t for p in prompts for t in p]
    out["token_ids"][: len(tokens)] = tokens
    out["positions"][: len(tokens)] = [pos for n in lengths for pos in range(n)]
    out["slots"][: len(tokens)] = [tables[i][pos // block] * block + pos % block
                                   for i, n in enumerate(lengths) for pos in range(n)]
    out["block_tables"][:requests, :per_seq] = tables
    out["seq_lens"][:requests] = lengths
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    out["query_start"][: requests + 1] = starts
    out["lm_rows"][:requests] = [s - 1 for s in starts[1:]]
    plan = StepPlan(num_tokens=len(tokens), num_decode=0, num_prefill=requests, block_width=per_seq,
                    num_sample=requests, num_score=0)
    logits = [runner.run_plan(plan, pool.layer_caches).logits]
    for step in choices:
        out["token_ids"][:requests] = step
        out["positions"][:requests] = lengths
        out["slots"][:requests] = [tables[i][n // block] * block + n % block for i, n in enumerate(lengths)]
        lengths = [n + 1 for n in lengths]
        out["seq_lens"][:requests] = lengths
        out["lm_rows"][:requests] = range(requests)
        plan = StepPlan(num_tokens=requests, num_decode=requests, num_prefill=0, block_width=per_seq,
                        num_sample=requests, num_score=0)
        logits.append(runner.run_plan(plan, pool.layer_caches).logits)
    return logits


def test_fp8_kv_logits_stay_within_tolerance_of_the_model_dtype_cache(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny", seed=4)
    model = load_model(model_dir, torch.float32, "cpu")
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 512) for _ in range(rng.randrange(5, 70))] for _ in range(12)]
    shape = dict(num_layers=2, num_blocks=12 * 6, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                 device="cpu")
    choices = [[rng.randrange(5, 512) for _ in prompts] for _ in range(8)]  # the same tokens into both caches
    reference = _prefill_then_decode(model, KVCachePool(**shape), prompts, choices)
    quantized = _prefill_then_decode(model, KVCachePool(**shape, fp8=True), prompts, choices)
    worst = max(((a - b).abs().max() / a.std()).item() for a, b in zip(reference, quantized))
    assert 0 < worst < KV_LOGIT_TOLERANCE


def test_fp8_kv_pool_holds_more_tokens_in_the_same_memory(tmp_path):
    head_dim = 128
    bf16 = KVCachePool.bytes_per_block(32, 64, 8, head_dim, torch.bfloat16)
    assert bf16 / KVCachePool.bytes_per_block(32, 64, 8, head_dim, torch.bfloat16, fp8=True) > 1.9
    model_dir = make_tiny_model(tmp_path / "tiny", seed=2, head_dim=head_dim, num_heads=2, num_kv_heads=1)
    # The same memory for both pools: on CPU a fixed budget (sizing.CPU_KV_BUDGET_BYTES) times the fraction. A GPU's
    # is the fraction of the device less what is in use (the CUDA context and, for the second engine, the first's
    # pool), which a fraction small enough to stay under the pool's cap leaves below zero.
    budget = dict(device="cpu", dtype="bfloat16", block_size_tokens=16, kv_cache_memory_fraction=2e-4)
    pools = {kv: MegatronLLM(str(model_dir), InferenceConfig(**budget, kv_cache_dtype=kv)).engine.kv_cache
             for kv in ("auto", "fp8")}
    assert pools["auto"].dtype == torch.bfloat16 and pools["fp8"].dtype == torch.float8_e4m3fn
    assert pools["fp8"].shape[2] / pools["auto"].shape[2] == pytest.approx(2 * head_dim / (head_dim + 4), rel=0.02)
    assert pools["fp8"].num_bytes <= pools["auto"].num_bytes


def test_fp8_kv_prefix_caching_and_preemption_change_no_token(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny", seed=5)
    shared = "A paged cache splits memory into blocks of a fixed number of tokens, the way an operating system "
    prompts = [shared + p for p in PROMPTS] + PROMPTS
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=24, ignore_eos=True)
    _, roomy = _generate(model_dir, prompts, params, kv_cache_dtype="fp8", enable_prefix_caching=False)
    llm, cached = _generate(model_dir, prompts, params, kv_cache_dtype="fp8")
    assert llm.engine.load().cached_tokens > 0
    tight = MegatronLLM(str(model_dir), InferenceConfig(dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=14,
                                                        block_size_tokens=8, enable_prefix_caching=False))
    outs = tight.generate(prompts, params)
    assert sum(1 for o in outs for e in o.events if e.type is EventType.PREEMPT) > 5
    assert cached == roomy and [(o.generated_tokens, o.generated_log_probs) for o in outs] == roomy


def _benchmark(argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """``python benchmarks/fp8.py ARGV``'s exit code and output, run in this process: its ``main`` is what the
    command runs, and a process of its own would import torch and the engine again (seconds of CPU)."""
    spec = importlib.util.spec_from_file_location("fp8_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)  # it puts benchmarks/ first on sys.path for its sibling's helpers
    finally:
        sys.path[:] = path
    # Its free_memory() collects garbage after each engine so that a GPU gets the memory back; here that is a full
    # collection of pytest's whole heap (about 0.4 CPU-s, nine times) for host memory nothing waits for.
    monkeypatch.setattr(module.roofline, "free_memory", lambda: None)
    capsys.readouterr()
    code = module.main(argv)
    return code, capsys.readouterr().out


def test_fp8_kv_greedy_agreement_over_200_random_prompts_is_above_the_floor(capsys, monkeypatch):
    code, out = _benchmark(["agreement", "--prompts", "200"], capsys, monkeypatch)
    assert code == 0, out[-2000:]
    match = re.search(r"fp8 KV greedy agreement: ([\d.]+)% of tokens .* over 200 prompts", out)
    assert match, out
    assert float(match[1]) / 100 >= AGREEMENT_FLOOR, out


def test_fp8_benchmark_smoke_prints_every_target(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    code, out = _benchmark(["--smoke", "targets", "gemm"], capsys, monkeypatch)
    assert code == 0, out[-2000:]
    for label in ("decode b1", "decode b64", "decode b256 fp8 KV"):
        assert re.search(rf"{label}\s+\d+\.\d\d", out), out
    assert re.search(r"tiny\s+1\s+[\d.]+\s+[\d.]+", out), out


@pytest.mark.parametrize(("flags", "quantization", "kv"), [
    ([], None, "auto"),
    (["--quantization", "fp8", "--kv-cache-dtype", "fp8"], "fp8", "fp8"),
    (["--kv-cache-dtype", "fp8_e4m3"], None, "fp8"),  # vLLM's spelling of the same thing
])
def test_fp8_engine_options_reach_the_config_and_travel_to_fleet_processes(flags, quantization, kv):
    import argparse

    from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args
    from megatron_serve.fleet.argv import inference_config_to_argv

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    config = inference_config_from_args(parser.parse_args(flags))
    assert (config.quantization, config.kv_cache_dtype) == (quantization, kv)
    assert inference_config_from_args(parser.parse_args(inference_config_to_argv(config))).to_dict() == config.to_dict()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("quantization", "int4", "quantization must be one of fp8"),
    ("kv_cache_dtype", "fp8_e5m2", "kv_cache_dtype must be one of auto, fp8, fp8_e4m3"),
])
def test_unknown_fp8_settings_are_refused_naming_them(field, value, message):
    with pytest.raises(ValueError, match=message):
        InferenceConfig(**{field: value})
