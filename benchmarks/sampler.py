"""Sampling a whole batch at once against sampling it row by row, in the same process.

The row-by-row baseline calls the same ``Sampler`` once per request, which is what a per-row loop
costs: a device round trip per row. Each request holds a slot of one ``SamplingState`` (bound once,
before the timing), as in the engine. Prints milliseconds per step and the ratio, for greedy,
temperature + top-p, and seeded rows, on CUDA when present, else CPU.

    python benchmarks/sampler.py
    python benchmarks/sampler.py --batch 256 --vocab 128256
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_serve.engine.sampling.sampler import Sampler
from megatron_serve.engine.sampling.sampling_state import SamplingState
from megatron_serve.wire.sampling_params import SamplingParams

from cli_options import add_number_options

MIXES = {
    "greedy + logprobs": lambda i: SamplingParams(temperature=0.0, return_log_probs=True),
    "temp 0.8 top-p 0.9": lambda i: SamplingParams(temperature=0.8, top_p=0.9),
    "top-k 50, seeded": lambda i: SamplingParams(temperature=1.0, top_k=50, seed=i),
}


def seconds_per_step(run, device: torch.device, iters: int) -> float:
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_number_options(parser, batch=64, vocab=32000, iters=20)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    logits = torch.randn(args.batch, args.vocab, device=device) * 3
    indices = list(range(args.batch))
    print(f"device {device}; batch {args.batch}; vocab {args.vocab}; ms per step")
    print(f"{'rows':>20} {'batched':>9} {'per row':>9} {'speed-up':>9}")
    for name, make in MIXES.items():
        state = SamplingState(args.vocab, device, args.batch)
        sampler = Sampler(state)
        keys = [str(i) for i in indices]
        for i, key in enumerate(keys):
            state.add(key, make(i), i, [], [], ())
        batched = seconds_per_step(lambda: sampler.launch(logits, state.rows(keys, indices, indices)).read(), device,
                                   args.iters)
        per_row = seconds_per_step(
            lambda: [sampler.launch(logits[i : i + 1], state.rows(keys[i : i + 1], [i], [i])).read()
                     for i in range(args.batch)], device, args.iters)
        print(f"{name:>20} {batched * 1e3:9.2f} {per_row * 1e3:9.2f} {per_row / batched:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
