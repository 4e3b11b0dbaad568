"""FP8 serving against bf16, measured in one run: the targets table, the GEMM choices, FP8 KV agreement.

``targets`` (GPU; Llama 3.1 8B shape, random bf16 weights, the FP8 runs quantize the same weights at
load with ``--quantization fp8``), each a ratio of two runs in this process:

* FP8 weights, batch-1 and batch-64 decode tokens/s over bf16 (targets 1.7x and 1.4x; bound 2x);
* FP8 KV: tokens the KV pool holds in the same memory (target 1.9x), and batch-256 decode tokens/s
  with FP8 KV over bf16 KV (target: not slower);
* serving (``benchmarks/serving.py``'s closed loop, concurrency 256): output tokens/s with FP8
  weights and FP8 KV over bf16 (target 1.5x).

``gemm`` (GPU): microseconds per projection of the 8B shapes at 1 to 4096 rows, bf16 ``F.linear``
against the three FP8 paths of ``megatron_kernels.triton_fp8_linear``: the weight-only kernel,
``torch._scaled_mm`` and the Triton FP8 x FP8 kernel. This is what its dispatch (and
``WEIGHT_ONLY_MAX_ROWS``) rests on.

``agreement`` (CPU or GPU): greedy decoding of 200 random prompts with the KV cache in the model
dtype and in FP8, on the same weights: the share of generated tokens before the first difference,
and of prompts whose whole continuation is identical. On CPU (a tiny random model, float32) a
bfloat16 run of the weights is printed beside it as a yardstick of how much any rounding moves
greedy choices of a random model (its logits are nearly flat: a trained model's are not).

    python benchmarks/fp8.py                      # targets, gemm and agreement (GPU)
    python benchmarks/fp8.py agreement            # CPU too
    python benchmarks/fp8.py --smoke              # tiny shapes, runs on CPU: checks the plumbing
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_roofline as roofline  # noqa: E402 - a sibling benchmark's helpers

TARGETS = {"decode b1": 1.7, "decode b64": 1.4, "KV tokens": 1.9, "decode b256 fp8 KV": 1.0, "serving c256": 1.5}
GEMM_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


# ------------------------------------------------------------------------------------------- agreement


def greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int, device: str, dtype: str, kv: str
           ) -> list[list[int]]:
    from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams  # noqa: PLC0415

    llm = MegatronLLM(str(model_dir), InferenceConfig(dtype=dtype, device=device, kv_cache_dtype=kv,
                                                       max_requests=64, max_batch_tokens=4096))
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=new_tokens, ignore_eos=True)
    return [out.generated_tokens for out in llm.generate(prompts, params)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(share of tokens before each prompt's first difference, share of identical continuations)."""
    kept = sum(sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(a, b)))
               for a, b in zip(reference, other))
    return kept / sum(len(a) for a in reference), sum(a == b for a, b in zip(reference, other)) / len(reference)


def run_agreement(model_dir: Path | None, count: int, new_tokens: int, device: str, workdir: Path) -> float:
    from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415

    if model_dir is None:
        model_dir = make_tiny_model(workdir / "tiny-llama", seed=3)
    import json  # noqa: PLC0415

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randrange(8, 64))] for _ in range(count)]
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    reference = greedy(model_dir, prompts, new_tokens, device, dtype, "auto")
    tokens, identical = agreement(reference, greedy(model_dir, prompts, new_tokens, device, dtype, "fp8"))
    print(f"fp8 KV greedy agreement: {100 * tokens:.1f}% of tokens ({100 * identical:.1f}% of prompts identical) "
          f"over {count} prompts x {new_tokens} tokens, {dtype} on {device}")
    if dtype == "float32":
        tokens_bf16, identical_bf16 = agreement(reference, greedy(model_dir, prompts, new_tokens, device,
                                                                   "bfloat16", "auto"))
        print(f"  yardstick, bfloat16 weights and KV against float32: {100 * tokens_bf16:.1f}% of tokens "
              f"({100 * identical_bf16:.1f}% of prompts identical)")
    return tokens


# ----------------------------------------------------------------------------------------------- gemm


def run_gemm(device: torch.device, rows_list: list[int], shapes: dict[str, tuple[int, int]]) -> None:
    import torch.nn.functional as F  # noqa: PLC0415

    from megatron_kernels import fp8  # noqa: PLC0415
    from megatron_kernels import triton_fp8_linear as lin  # noqa: PLC0415

    iters = 50 if device.type == "cuda" else 2
    print(f"\nGEMM microseconds per call ({device}); ratio = bf16 / FP8 (above 1: FP8 is faster)")
    header = f"{'proj':>8} {'rows':>5} {'bf16':>9} {'w-only':>9} {'scaled_mm':>9} {'triton8':>9}  best"
    print(header)
    print("-" * len(header))
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        q, scale = fp8.quantize(weight, None)
        for rows in rows_list:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            runs = {
                "bf16": lambda: F.linear(x, weight),
                "w-only": lambda: lin.fp8_linear_weight_only(x, q, scale, None),
                "scaled_mm": (lambda: lin.fp8_linear_scaled_mm(x, q, scale)) if lin._scaled_mm_fits(x, q, None)
                else None,
                "triton8": lambda: lin.fp8_linear_fp8_gemm(x, q, scale, None),
            }
            micros = {key: (1e6 * roofline.seconds_for(run, iters, device, warmup=3) / iters if run else None)
                      for key, run in runs.items()}
            fp8_best = min((v, key) for key, v in micros.items() if key != "bf16" and v is not None)
            cells = " ".join(f"{v:9.1f}" if v is not None else f"{'-':>9}" for v in micros.values())
            print(f"{name:>8} {rows:5d} {cells}  {fp8_best[1]} {micros['bf16'] / fp8_best[0]:.2f}x", flush=True)


# -------------------------------------------------------------------------------------------- targets


def kv_tokens(model, device: torch.device, kv: str, block_size: int) -> int:
    """Tokens the KV pool holds when sized by memory (the default fraction), this KV dtype."""
    from megatron_serve import InferenceConfig  # noqa: PLC0415
    from megatron_serve.engine.sizing import build_kv_pool  # noqa: PLC0415

    config = InferenceConfig(dtype=torch.bfloat16, device=str(device), block_size_tokens=block_size,
                             kv_cache_dtype=kv, max_requests=4096)
    pool = build_kv_pool(model, config, model.config.max_position_embeddings, device)
    tokens = pool.shape[2] * block_size
    pool.release()
    return tokens


def serving_tokens_per_s(model_dir: Path, run_args: str, concurrency: int, prompt_tokens: int, output_tokens: int,
                         vocab_size: int) -> float:
    """Output tokens/s of ``megatron-serve run`` (one engine) over ``4 * concurrency`` random prompts, ``concurrency``
    at a time, after a warm-up of 4."""
    import serving  # noqa: PLC0415 - the sibling benchmark, for its closed loop
    import serving_stack  # noqa: PLC0415

    proc, url, _ = serving_stack.start_stack(str(model_dir), 1, run_args)
    try:
        model = serving.httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        warmup = serving.workload(4, prompt_tokens, output_tokens, vocab_size, "uniform", 99)
        asyncio.run(serving.serve_level(url, model, {}, warmup, 4))
        work = serving.workload(4 * concurrency, prompt_tokens, output_tokens, vocab_size, "uniform", 1)
        samples, elapsed = asyncio.run(serving.serve_level(url, model, {}, work, concurrency))
        return sum(s.tokens for s in samples) / elapsed
    finally:
        serving_stack.stop_stack(proc)


def run_targets(shape_name: str, device: torch.device, workdir: Path, batches: tuple[int, int, int],
                prompt_len: int, new_tokens: int, serving_concurrency: int | None) -> list[tuple[str, float]]:
    from megatron_serve.model.loader import load_model  # noqa: PLC0415
    from megatron_serve.model.tiny import tiny_tokenizer  # noqa: PLC0415

    shape = roofline.LLAMA_SHAPES[shape_name]
    block = 64 if device.type == "cuda" else 16
    model_dir = roofline.build_checkpoint(shape_name, shape, workdir, device)
    if serving_concurrency:  # `megatron-serve run` needs a tokenizer: the tiny models', padded to the vocabulary
        tiny_tokenizer(shape["vocab_size"]).save_pretrained(str(model_dir))
    results: list[tuple[str, float]] = []
    measured: dict[tuple[str, int, str], float] = {}
    for quantization in (None, "fp8"):
        model = load_model(model_dir, torch.bfloat16, device, quantization=quantization)
        for batch in batches[:2]:
            measured[(str(quantization), batch, "auto")], _ = roofline.engine_decode_tokens_per_s(
                model, shape, batch, prompt_len, new_tokens, block, device, device.type == "cuda")
        if quantization is None:
            for kv in ("auto", "fp8"):
                measured[("None", batches[2], kv)], _ = roofline.engine_decode_tokens_per_s(
                    model, shape, batches[2], prompt_len, new_tokens, block, device, device.type == "cuda",
                    kv_cache_dtype=kv)
            if device.type == "cuda":
                results.append(("KV tokens", kv_tokens(model, device, "fp8", block) / kv_tokens(model, device, "auto",
                                                                                                 block)))
        del model
        roofline.free_memory()
    for label, batch in zip(("decode b1", "decode b64"), batches[:2]):
        results.append((label, measured[("fp8", batch, "auto")] / measured[("None", batch, "auto")]))
    results.append(("decode b256 fp8 KV", measured[("None", batches[2], "fp8")] / measured[("None", batches[2], "auto")]))
    if serving_concurrency:
        base_args = f"--dtype bfloat16 --max-requests {serving_concurrency}"
        base = serving_tokens_per_s(model_dir, base_args, serving_concurrency, prompt_len, new_tokens,
                                    shape["vocab_size"])
        fast = serving_tokens_per_s(model_dir, f"{base_args} --quantization fp8 --kv-cache-dtype fp8",
                                    serving_concurrency, prompt_len, new_tokens, shape["vocab_size"])
        results.append(("serving c256", fast / base))
    return results


def print_targets(results: list[tuple[str, float]], device: str) -> None:
    print(f"\nFP8 against bf16 on {device} (ratios of runs in this process)")
    print(f"{'measure':>20} {'ratio':>7} {'target':>7}")
    for label, ratio in results:
        target = TARGETS.get(label)
        verdict = "" if target is None else ("  met" if ratio >= target else "  MISSED")
        print(f"{label:>20} {ratio:7.2f} {target if target is not None else '-':>7}{verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="*", help="targets, gemm and/or agreement (default: all three)")
    parser.add_argument("--model", type=Path, default=None, help="agreement: this model (default: a tiny random one)")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=16, help="agreement: tokens generated per prompt")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few prompts; allowed on CPU")
    args = parser.parse_args(argv)
    args.what = args.what or ["targets", "gemm", "agreement"]
    unknown = set(args.what) - {"targets", "gemm", "agreement"}
    if unknown:
        parser.error(f"unknown measurement {', '.join(sorted(unknown))}: choose targets, gemm, agreement")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu_only = {"targets", "gemm"} & set(args.what)
    if device.type != "cuda" and gpu_only and not args.smoke:
        print(f"{', '.join(sorted(gpu_only))} need a CUDA GPU (use --smoke to check the plumbing on CPU)")
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        if "gemm" in args.what:
            run_gemm(device, [1, 4] if args.smoke else [1, 16, 64, 256, 4096],
                     {"tiny": (64, 128)} if args.smoke else GEMM_SHAPES)
        if "targets" in args.what:
            results = (run_targets("smoke", device, Path(tmp), (1, 4, 8), 16, 8, None) if args.smoke
                       else run_targets("8b", device, Path(tmp), (1, 64, 256), 128, 128, 256))
            print_targets(results, name)
        if "agreement" in args.what:
            started = time.perf_counter()
            run_agreement(args.model, 10 if args.smoke else args.prompts, args.new_tokens, str(device), Path(tmp))
            print(f"  ({time.perf_counter() - started:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
