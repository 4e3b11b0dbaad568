"""Prefix caching off vs on: throughput and time to first token on a shared-prefix workload.

``MegatronLLM`` in direct mode, in this process, with the same weights both times. The workload:
``--prefixes`` long prefixes (a system prompt, a few-shot block, an RL task statement) shared by
``--requests`` requests, each with its own short tail; greedy, EOS ignored.

Two measurements per setting:

* burst: every request submitted at once (``generate``), continuous batching to completion:
  wall time, requests/s, generated tokens/s, TTFT (arrival to first token, queueing included);
* lone: ``--lone`` requests one at a time after the burst (the prefixes are warm when caching is
  on): TTFT of a request that has the engine to itself, i.e. its prefill time.

Outputs with caching on must equal those with caching off (checked).

    python benchmarks/prefix_cache.py                                  # CPU-sized defaults
    python benchmarks/prefix_cache.py --hidden-size 1024 --layers 16 --prefix-len 2048 --requests 256  # a GPU
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.model.tiny import make_tiny_model

from cli_options import add_number_options


def workload(vocab: int, prefixes: int, prefix_len: int, requests: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(5, vocab) for _ in range(prefix_len)] for _ in range(prefixes)]
    return [heads[i % prefixes] + [rng.randrange(5, vocab) for _ in range(rng.randint(8, 48))]
            for i in range(requests)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(model_dir: str, prompts: list[list[int]], lone: list[list[int]], caching: bool, args) -> dict:
    config = InferenceConfig(dtype=args.dtype, device=args.device, max_requests=args.max_requests,
                             max_batch_tokens=args.max_batch_tokens, enable_prefix_caching=caching,
                             num_kv_blocks=args.num_kv_blocks)
    llm = MegatronLLM(model_dir, config)
    engine = llm.engine
    warm = [[7 + (i % 400) for i in range(64)]]  # warm-up of kernels, sharing no block with the workload
    llm.generate(warm, SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True))
    before = engine.load()
    cached0, computed0 = before.cached_tokens, before.computed_tokens
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=args.output_len, ignore_eos=True)
    _sync(args.device)
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(args.device)
    elapsed = time.perf_counter() - started
    ttfts = [o.ttft for o in outs]
    after = engine.load()
    burst_cached, burst_computed = after.cached_tokens - cached0, after.computed_tokens - computed0
    lone_ttfts = []
    for prompt in lone:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, num_tokens_to_generate=1, ignore_eos=True))[0]
        lone_ttfts.append(out.ttft)
    result = {
        "tokens": [o.generated_tokens for o in outs],
        "wall_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": sum(len(o.generated_tokens) for o in outs) / elapsed,
        "ttft_mean_ms": 1000 * statistics.mean(ttfts),
        "ttft_p50_ms": 1000 * percentile(ttfts, 0.5),
        "ttft_p90_ms": 1000 * percentile(ttfts, 0.9),
        "lone_ttft_p50_ms": 1000 * statistics.median(lone_ttfts),
        "cached_tokens": burst_cached,
        "computed_tokens": burst_computed,
        "block_size": config.block_size_tokens,
        "kv_blocks": engine.allocator.num_blocks,
    }
    llm.close()
    del llm, engine
    if str(args.device).startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: a random model of the sizes below)")
    add_number_options(parser, hidden_size=256, layers=4, prefixes=4, prefix_len=512, requests=64, output_len=16)
    parser.add_argument("--lone", type=int, default=8, help="requests timed one at a time after the burst")
    parser.add_argument("--max-requests", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            max_pos = 1 << max(11, (args.prefix_len + 48 + args.output_len).bit_length())
            model_dir = str(make_tiny_model(tmp, seed=0, hidden_size=args.hidden_size, num_layers=args.layers,
                                            num_heads=8, num_kv_heads=4, intermediate_size=args.hidden_size * 8 // 3,
                                            max_position_embeddings=max_pos))
        prompts = workload(500, args.prefixes, args.prefix_len, args.requests, seed=0)
        lone = workload(500, args.prefixes, args.prefix_len, args.lone, seed=0)
        lone = [p[: args.prefix_len] + [9, 8, 7, 6, 5 + i] for i, p in enumerate(lone)]
        off = run(model_dir, prompts, lone, caching=False, args=args)
        on = run(model_dir, prompts, lone, caching=True, args=args)

    same = on["tokens"] == off["tokens"]
    prompt_tokens = sum(len(p) for p in prompts)
    shared = (args.requests - args.prefixes) * args.prefix_len / prompt_tokens
    print(f"device {args.device}, torch threads {torch.get_num_threads()}, block size {on['block_size']}, "
          f"KV blocks {on['kv_blocks']}")
    print(f"workload: {args.requests} requests over {args.prefixes} prefixes of {args.prefix_len} tokens, "
          f"{prompt_tokens} prompt tokens ({shared:.0%} shared beyond each prefix's first use), "
          f"{args.output_len} generated each; outputs identical with caching on: {'yes' if same else 'NO'}")
    rows = [
        ("burst wall time (s)", "wall_s", "{:.2f}"),
        ("requests/s", "requests_per_s", "{:.2f}"),
        ("generated tokens/s", "output_tokens_per_s", "{:.1f}"),
        ("TTFT mean (ms), burst", "ttft_mean_ms", "{:.0f}"),
        ("TTFT p50 (ms), burst", "ttft_p50_ms", "{:.0f}"),
        ("TTFT p90 (ms), burst", "ttft_p90_ms", "{:.0f}"),
        ("TTFT p50 (ms), lone request", "lone_ttft_p50_ms", "{:.1f}"),
        ("tokens computed, burst", "computed_tokens", "{:d}"),
        ("prompt tokens from cache, burst", "cached_tokens", "{:d}"),
    ]
    print(f"{'':<34}{'caching off':>14}{'caching on':>14}{'on / off':>10}")
    for label, key, fmt in rows:
        ratio = f"{on[key] / off[key]:.2f}x" if off[key] else "-"
        print(f"{label:<34}{fmt.format(off[key]):>14}{fmt.format(on[key]):>14}{ratio:>10}")
    if not same:
        raise SystemExit("outputs differ between caching off and on")


if __name__ == "__main__":
    main()
