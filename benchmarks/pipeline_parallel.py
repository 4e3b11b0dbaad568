"""Pipeline stages with and without micro-batches, against one stage, on a dense model (gloo on CPU, NCCL on GPUs).

One table: per generated token (greedy, ``--concurrency`` requests at once), the wall milliseconds and the CPU
milliseconds of the whole group (every rank's process: this one's CPU time and each other rank's from
``/proc/PID/stat``, so Linux only), for one stage and for ``P`` stages with one micro-batch a step (the stages run one
after another) and with ``M`` micro-batches (``--pipeline-micro-batches``: stage ``s`` runs micro-batch ``m`` while
stage ``s - 1`` runs ``m + 1``), each with its ratio to one stage measured in the same run. CPU time per token says
what the split costs in work (messages, smaller GEMMs); the wall time says what the overlap buys where the stages
have processors of their own.

    python benchmarks/pipeline_parallel.py                          # CPU: 2 and 3 stages, 1 vs P micro-batches
    python benchmarks/pipeline_parallel.py --device cuda --stages 2 4 --hidden 2048 --layers 16 --concurrency 64
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams  # noqa: E402
from megatron_serve.model.tiny import make_tiny_model  # noqa: E402


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (``/proc/PID/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(llm: MegatronLLM) -> float:
    """CPU seconds of this process and of every other rank of its engine group."""
    workers = getattr(llm.engine.worker.runner, "workers", [])
    return time.process_time() + sum(process_cpu_seconds(w.pid) for w in workers)


def per_token(model_dir: str, args: argparse.Namespace, stages: int, micro_batches: int | None) -> tuple[float, float]:
    """(wall ms, group CPU ms) per generated token of one layout, after a warm-up request."""
    config = InferenceConfig(dtype=args.dtype, device=args.device, pipeline_parallel_size=stages,
                             pipeline_micro_batches=micro_batches, num_kv_blocks=512, max_requests=args.concurrency)
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=args.tokens, ignore_eos=True)
    prompts = [f"Pipeline benchmark prompt {i}: the quick brown fox jumps" for i in range(args.concurrency)]
    with MegatronLLM(model_dir, config) as llm:
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True))
        cpu, started = group_cpu_seconds(llm), time.perf_counter()
        outs = llm.generate(prompts, params)
        wall, cpu = time.perf_counter() - started, group_cpu_seconds(llm) - cpu
    tokens = sum(len(o.generated_tokens) for o in outs)
    return 1000 * wall / tokens, 1000 * cpu / tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=7, help="uneven over 2 and 3 stages by default")
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens a request")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--model", default=None,
                        help="a dense model directory instead of a random one of --hidden, --layers and "
                             "--intermediate (a caller that has one made skips importing its transformers model class "
                             "here); the table's header still prints the options")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        model_dir = args.model or str(make_tiny_model(Path(root) / "dense", seed=0, hidden_size=args.hidden, num_layers=args.layers,
                                        num_heads=8, num_kv_heads=4, intermediate_size=args.intermediate))
        print(f"ms per generated token ({args.concurrency} requests of {args.tokens} tokens, {args.layers} layers, "
              f"hidden {args.hidden}, {args.device}, {args.dtype})")
        print(f"{'layout':<22} {'wall':>8} {'ratio':>7} {'cpu':>8} {'ratio':>7}")
        wall_1, cpu_1 = per_token(model_dir, args, 1, None)
        print(f"{'one stage':<22} {wall_1:>8.2f} {1.0:>7.2f} {cpu_1:>8.2f} {1.0:>7.2f}")
        for stages in args.stages:
            for micro_batches in (1, stages):
                wall, cpu = per_token(model_dir, args, stages, micro_batches)
                name = f"PP={stages} micro-batches {micro_batches}"
                print(f"{name:<22} {wall:>8.2f} {wall / wall_1:>7.2f} {cpu:>8.2f} {cpu / cpu_1:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
