"""What ``--batch-invariant`` costs: offline and served throughput with and without the mode, in one run.

The same random weights and requests run through the engine twice per row, default mode then
batch-invariant, greedy and sampled (temperature 1, ``n`` samples per prompt with seeds), dense
(Llama) and mixture-of-experts (Qwen3-MoE). Each row reports generated tokens per second of wall
time and milliseconds of process CPU time per generated token (the honest measure on a shared
machine), and the mode's throughput as a fraction of the default's. Both modes are warmed up first (an
engine's first steps pay one-time costs) and run ``--repeat`` times, alternately; each row reports each
mode's fastest run (the one least disturbed by other work on the machine). ``--row-tiles`` sweeps the
invariant GEMMs' row padding (``megatron_kernels.invariant.row_tile``) to compare tiles.

``--served`` adds the same comparison through the OpenAI HTTP API: ``megatron-serve run`` started with
and without ``--batch-invariant`` (one engine), every request of the row streamed at once with
``benchmarks/serving.py``'s client (sampled rows as one request with ``n`` choices per prompt, no
seed), output tokens per second of wall time and the stack's CPU time per token (server, coordinator
and engine processes together).

    OMP_NUM_THREADS=1 python benchmarks/batch_invariance.py [--requests 32] [--repeat 3] \
        [--hidden-size 256 --layers 4] [--row-tiles 16,32,64] [--served]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile

import httpx
import torch

from megatron_kernels import invariant
from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine
from megatron_serve.model.tiny import make_tiny_model

import serving
import serving_stack
from engine_run import run_to_end


def workload(count: int, samples: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """``count`` requests of mixed lengths; sampled: ``count // samples`` prompts with ``samples`` seeded draws each."""
    rng = random.Random(seed)
    if samples == 1:
        return [([rng.randrange(5, 500) for _ in range(rng.randint(16, 128))],
                 SamplingParams(temperature=0.0, num_tokens_to_generate=rng.randint(16, 64), ignore_eos=True,
                                return_log_probs=True)) for _ in range(count)]
    out = []
    for prompt_index in range(count // samples):
        prompt = [rng.randrange(5, 500) for _ in range(rng.randint(16, 128))]
        length = rng.randint(16, 64)
        out += [(prompt, SamplingParams(temperature=1.0, seed=prompt_index * samples + i, num_tokens_to_generate=length,
                                        ignore_eos=True, return_log_probs=True)) for i in range(samples)]
    return out


def measure(model_dir: str, invariant_mode: bool, requests, dtype: str, device: str = "cpu"
            ) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, generated tokens) of the whole workload in flight together."""
    engine = DynamicInferenceEngine.from_model_dir(model_dir, InferenceConfig(
        dtype=dtype, device=device, batch_invariant=invariant_mode, max_requests=64, max_batch_tokens=512))
    reqs = [DynamicInferenceRequest(str(i), None, prompt, params) for i, (prompt, params) in enumerate(requests)]
    wall, cpu = run_to_end(engine, reqs)
    engine.shutdown()
    return wall, cpu, sum(len(r.generated_tokens) for r in reqs)


def fastest(model_dir: str, requests, args: argparse.Namespace
            ) -> tuple[tuple[float, float, int], tuple[float, float, int]]:
    """The default's and the mode's least CPU-costly run of ``args.repeat``, run alternately."""
    runs: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
    for _ in range(args.repeat):
        for invariant_mode in (False, True):
            runs[invariant_mode].append(measure(model_dir, invariant_mode, requests, args.dtype, args.device))
    return min(runs[False], key=lambda run: run[1]), min(runs[True], key=lambda run: run[1])


def served(model_dir: str, invariant_mode: bool, requests, dtype: str, device: str, samples: int
           ) -> tuple[float, float, int]:
    """(wall seconds, stack CPU seconds, output tokens) of ``requests`` streamed at once to a started stack."""
    prompts = requests[::samples]
    work = serving.Workload([prompt for prompt, _ in prompts], [params.num_tokens_to_generate for _, params in prompts])
    serving.SAMPLING = serving.Sampling(temperature=prompts[0][1].temperature, n=samples)
    run_args = (f"--dtype {dtype} --device {device} --max-requests 64 --max-batch-tokens 512"
                + " --batch-invariant" * invariant_mode)
    proc, url, _ = serving_stack.start_stack(model_dir, 1, run_args)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        asyncio.run(serving.serve_level(url, model, {}, serving.Workload(work.prompts[:2], [4, 4]), 2))  # warm-up
        cpu_before = sum((serving_stack.stack_cpu_seconds(proc.pid) or {}).values())
        results, elapsed = asyncio.run(serving.serve_level(url, model, {}, work, len(work.prompts)))
        cpu = sum((serving_stack.stack_cpu_seconds(proc.pid) or {}).values()) - cpu_before
    finally:
        serving_stack.stop_stack(proc)
    return elapsed, cpu, sum(result.tokens for result in results)


def print_row(arch: str, label: str, tile: int | str, base: tuple[float, float, int], mode: tuple[float, float, int]
              ) -> None:
    (base_wall, base_cpu, tokens), (wall, cpu, _) = base, mode
    print(f"{arch:<11}{label:<21}{tile:>5}{tokens / base_wall:>15.1f}{tokens / wall:>17.1f}"
          f"{base_wall / wall:>12.2f}{1e3 * base_cpu / tokens:>20.2f}{1e3 * cpu / tokens:>22.2f}"
          f"{base_cpu / cpu:>11.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8, help="n of the sampled rows")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--archs", default="llama,qwen3_moe")
    parser.add_argument("--row-tiles", default=str(invariant.row_tile()),
                        help="comma-separated row tiles (default: the one this CPU's probe settles on)")
    parser.add_argument("--repeat", type=int, default=3, help="offline runs per mode, alternately; the fastest counts")
    parser.add_argument("--served", action="store_true", help="also through the HTTP API (a started stack)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, hidden {args.hidden_size}, "
          f"{args.layers} layers, {args.requests} requests")
    print(f"{'model':<11}{'sampling':<21}{'tile':>5}{'default tok/s':>15}{'invariant tok/s':>17}{'wall ratio':>12}"
          f"{'default CPU ms/tok':>20}{'invariant CPU ms/tok':>22}{'CPU ratio':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            model_dir = str(make_tiny_model(f"{tmp}/{arch}", seed=0, arch=arch, hidden_size=args.hidden_size,
                                            num_layers=args.layers, num_heads=8, num_kv_heads=4,
                                            intermediate_size=args.hidden_size * 8 // 3))
            for warm in (False, True):  # first-call costs, in both modes
                measure(model_dir, warm, workload(4, 1, seed=9), args.dtype, args.device)
            for label, samples in (("greedy", 1), (f"sampled n={args.samples}", args.samples)):
                requests = workload(args.requests, samples, seed=0)
                for tile in (int(t) for t in args.row_tiles.split(",")):
                    invariant._row_tile = tile  # noqa: SLF001 - the sweep sets what the probe would
                    base, mode = fastest(model_dir, requests, args)
                    assert mode[2] == base[2]
                    print_row(arch, f"{label} offline", tile, base, mode)
                tokens = base[2]
                if args.served:
                    base = served(model_dir, False, requests, args.dtype, args.device, samples)
                    mode = served(model_dir, True, requests, args.dtype, args.device, samples)
                    assert mode[2] == base[2] == tokens, (base[2], mode[2], tokens)
                    print_row(arch, f"{label} served", "", base, mode)


if __name__ == "__main__":
    main()
