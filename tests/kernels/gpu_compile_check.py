"""Compile every Triton kernel, as the op wrappers launch it on a GPU, for a CUDA target without a GPU.

Run as a script (``python tests/kernels/gpu_compile_check.py 90 [--quick]``, ``--quick`` = bf16 only) in
a process *without* ``TRITON_INTERPRET``: it replaces ``JITFunction.run`` with ahead-of-time compilation
through ``ptxas``, drives the real op wrappers with CPU tensors and GPU tile heuristics, and prints one
line per launch.
This catches what only a GPU build rejects (``tl.dot`` tiles under 16, loop-carried type changes,
shared-memory overflow) on machines that have no GPU. Exit status 1 when any launch fails to compile.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
        torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv"}


def _signature(fn: JITFunction, args, kwargs):
    bound = dict(zip(fn.arg_names, args))
    bound.update(kwargs)
    signature, constexprs = {}, {}
    for param, name in zip(fn.params, fn.arg_names):
        value = bound[name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = _PTR[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={value!r}")
    return signature, constexprs


@functools.cache
def _quantized(fp8, shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight of ``shape`` and its scales, made once: every case launches weights of the same shapes, and
    their values never reach a kernel (compiled, not run)."""
    return fp8.quantize(torch.ones(shape), block)


def _fp8_launches(ops, fp8, dtype, q, k, positions, cos, tables, lens, qsl, hkv: int, head_dim: int) -> None:
    """The FP8 launches: KV writes into an FP8 cache and attention over it, FP8 linears, FP8 experts."""
    from megatron_kernels.moe_weights import ExpertWeights  # noqa: PLC0415
    from megatron_kernels.paged_kv import PagedKV  # noqa: PLC0415

    k8 = torch.zeros(64, 16, hkv, head_dim, dtype=torch.float8_e4m3fn)
    cache = PagedKV(k8, torch.zeros_like(k8), torch.zeros(64, 16, hkv), torch.zeros(64, 16, hkv))
    ops.apply_rotary_write_kv_cache(q, k, k, positions, cos, cos, cache, positions)
    ops.write_kv_cache(k, k, cache, positions)
    ops.paged_attention_decode(q[:4], cache, tables, lens, 0.1)
    ops.paged_attention_prefill(q, cache, tables, qsl, lens, 0.1)
    for block in (None, (128, 128)):
        weight, weight_scale = _quantized(fp8, (1024, 2048), block)
        for rows in (1, 48, 512):  # weight-only (split-K and not), FP8 x FP8
            ops.fp8_linear(torch.randn(rows, 2048, dtype=dtype), weight, weight_scale, block)
        w13, w13_scale = _quantized(fp8, (8, 2 * 768, 2048), block)
        w2, w2_scale = _quantized(fp8, (8, 2048, 768), block)
        experts = ExpertWeights(w13, w2, w13_scale, w2_scale, block)
        for moe_tokens in (4, 512):
            ops.fused_moe(torch.randn(moe_tokens, 2048, dtype=dtype), experts, torch.rand(moe_tokens, 2),
                          torch.randint(0, 8, (moe_tokens, 2)))
    weight, weight_scale = _quantized(fp8, (1024, 2048), None)  # a checkpoint's static activation scale
    ops.fp8_linear(torch.randn(100, 2048, dtype=dtype), weight, weight_scale, None, input_scale=torch.tensor([0.5]))


def main(capability: int, quick: bool = False) -> int:
    target = GPUTarget("cuda", capability, 32)
    failures: list[str] = []
    compiled: set[tuple] = set()

    def compile_instead_of_run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in ("num_warps", "num_stages")}
        signature, constexprs = _signature(self, args, kwargs)
        key = (self.__name__, tuple(sorted(signature.items())), tuple(sorted(constexprs.items(), key=str)),
               tuple(sorted(options.items())))
        if key in compiled:
            return None
        compiled.add(key)
        try:
            kernel = triton.compile(ASTSource(self, signature, constexprs), target=target, options=options)
            print(f"ok   {self.__name__:24s} shared={kernel.metadata.shared}", flush=True)
        except Exception as exc:  # noqa: BLE001 - report every failing launch
            failures.append(self.__name__)
            print(f"FAIL {self.__name__}: {str(exc)[-2000:]}", flush=True)
        return None

    JITFunction.run = compile_instead_of_run

    from megatron_kernels import _triton_utils, fp8  # noqa: PLC0415
    from megatron_kernels import triton_activation, triton_decode_attention, triton_kv_cache  # noqa: PLC0415
    from megatron_kernels import triton_fp8_linear, triton_lora, triton_moe, triton_norm  # noqa: PLC0415
    from megatron_kernels import triton_invariant_attention, triton_paged_attention  # noqa: PLC0415
    from megatron_kernels import triton_prefill_attention, triton_rotary  # noqa: PLC0415

    modules = (triton_activation, triton_decode_attention, triton_kv_cache, triton_moe, triton_norm,
               triton_paged_attention, triton_prefill_attention, triton_rotary, triton_fp8_linear, triton_lora)
    for module in modules:  # GPU launch heuristics on CPU tensors
        if hasattr(module, "interpreted"):
            module.interpreted = lambda t: False
        if hasattr(module, "tile_budget"):
            module.tile_budget = lambda t: 1 << 12
    _triton_utils.interpreted = lambda t: False
    _triton_utils.tile_budget = lambda t: 1 << 12
    triton_decode_attention.sm_count = lambda device: 132
    triton_fp8_linear.sm_count = lambda device: 132

    from megatron_kernels import triton_ops as ops  # noqa: PLC0415
    from megatron_kernels.moe_weights import ExpertWeights  # noqa: PLC0415
    from megatron_kernels.paged_kv import PagedKV  # noqa: PLC0415
    from megatron_kernels.reference_lora import LoraBatch  # noqa: PLC0415

    # heads of 8 and 12 (the parity search's small models) pad to tl.dot's 16 (a GPU build refused 8 as it stood)
    cases = [(torch.bfloat16, (32, 8, 128)), (torch.bfloat16, (1, 1, 8)), (torch.bfloat16, (6, 6, 12)),
             (torch.float32, (8, 2, 64))]
    for dtype, (hq, hkv, head_dim) in [c for c in cases if c[0] == torch.bfloat16] if quick else cases:
        tokens, block_size, num_blocks = 40, 16, 64
        q = torch.randn(tokens, hq, head_dim, dtype=dtype)
        k = torch.randn(tokens, hkv, head_dim, dtype=dtype)
        k_cache = torch.zeros(num_blocks, block_size, hkv, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        cache = PagedKV(k_cache, v_cache)
        tables = torch.zeros(4, 16, dtype=torch.int32)
        lens = torch.full((4,), 30, dtype=torch.int32)
        qsl = torch.tensor([0, 10, 20, 30, 40], dtype=torch.int32)
        ops.paged_attention_decode(q[:4], cache, tables, lens, 0.1)
        triton_decode_attention.paged_attention_decode(q[:2], cache, tables[:2], lens[:2], 0.1, num_splits=4)
        ops.paged_attention_prefill(q, cache, tables, qsl, lens, 0.1)
        long_q = torch.zeros(4096, hq, head_dim, dtype=dtype)  # long prompts take the 128-row tile
        ops.paged_attention_prefill(long_q, cache, tables[:1], qsl[:2] * 0 + torch.tensor([0, 4096]), lens[:1], 0.1)
        cos = torch.randn(100, head_dim // 2)
        positions = torch.arange(tokens)
        ops.apply_rotary(q, k, positions, cos, cos)
        ops.apply_rotary_write_kv_cache(q, k, k, positions, cos, cos, cache, positions)
        ops.write_kv_cache(k, k, cache, positions)
        x = torch.randn(7, 2048, dtype=dtype)
        ops.rms_norm(x, torch.ones(2048, dtype=dtype), 1e-5)
        ops.fused_add_rms_norm(x, x, torch.ones(2048, dtype=dtype), 1e-5)
        ops.silu_and_mul(torch.randn(3, 2 * 1024, dtype=dtype))
        # the weights' values never reach a kernel (compiled, not run), only their shapes: ones, not random draws
        w13, w2 = torch.ones(8, 2 * 768, 2048, dtype=dtype), torch.ones(8, 2048, 768, dtype=dtype)
        for moe_tokens in (4, 512):  # decode (16-row blocks) and prefill (64-row blocks)
            ids = torch.randint(0, 8, (moe_tokens, 2))
            ops.fused_moe(torch.randn(moe_tokens, 2048, dtype=dtype), ExpertWeights(w13, w2), torch.rand(moe_tokens, 2),
                          ids)
        slots = LoraBatch.of_padded(torch.zeros(tokens, dtype=torch.long))  # LoRA: a rank-16 adapter on a projection
        lora_a, lora_b = torch.zeros(2, 16, 2048, dtype=dtype), torch.zeros(2, 1024, 16, dtype=dtype)
        ops.lora_expand(torch.zeros(tokens, 1024, dtype=dtype), ops.lora_shrink(torch.zeros(tokens, 2048, dtype=dtype),
                                                                                lora_a, slots), lora_b, slots)
        rows = torch.zeros(tokens, dtype=torch.long)  # --batch-invariant's attention, plain and over an FP8 cache
        triton_invariant_attention.paged_attention(q, k_cache, v_cache, tables, rows, rows, 0.1)
        if capability >= 89:
            k8, kv_scales = torch.zeros(num_blocks, block_size, hkv, head_dim, dtype=torch.float8_e4m3fn), \
                torch.zeros(num_blocks, block_size, hkv)
            triton_invariant_attention.paged_attention(q, k8, k8, tables, rows, rows, 0.1, k_scales=kv_scales,
                                                       v_scales=kv_scales)
        if capability >= 89:  # FP8: e4m3 conversions and FP8 tl.dot need Ada or Hopper
            _fp8_launches(ops, fp8, dtype, q, k, positions, cos, tables, lens, qsl, hkv, head_dim)
    print(f"{len(compiled)} launches compiled for sm_{capability}, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: the interpreter replaces the kernels this script compiles")
    args = [a for a in sys.argv[1:] if a != "--quick"]
    sys.exit(main(int(args[0]) if args else 90, quick="--quick" in sys.argv))
