"""What the engine's vLLM-style metrics cost the step loop: the same decode steps with and without them.

The baseline swaps ``engine.stats`` for a stand-in whose methods do nothing, in the same process
and on the same requests, so the ratio is the host time the counters and histograms add per step
(one ``observe`` per request that sampled); on a shared CPU that difference drowns in noise, so
it also times ``observe_step`` alone, and one heartbeat snapshot (``metrics_snapshot``, at most every
0.2 s). A tiny model keeps the model's share of a
step small, which makes the metrics' share look *larger* than on a real model.

    python benchmarks/engine_metrics.py
    python benchmarks/engine_metrics.py --batch 256 --tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from types import SimpleNamespace

from megatron_serve.config import InferenceConfig
from megatron_serve.engine import DynamicInferenceEngine, StepOutput
from megatron_serve.wire.engine_stats import EngineStats
from megatron_serve.wire.request import DynamicInferenceRequest, FinalRecord
from megatron_serve.wire.sampling_params import SamplingParams
from megatron_serve.model.tiny import make_tiny_model

from cli_options import add_number_options


class NoStats(EngineStats):
    """The baseline: the same interface, nothing counted."""

    def observe_step(self, *args: object, **kwargs: object) -> None:
        pass

    def preempted(self, count: int) -> None:
        pass

    def finish(self, record: FinalRecord) -> None:
        pass


def seconds_per_step(engine: DynamicInferenceEngine, batch: int, tokens: int) -> float:
    """Mean wall time of the decode steps of ``batch`` requests generating ``tokens`` each."""
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(DynamicInferenceRequest(f"r{time.monotonic_ns()}-{i}", None, [5 + i % 50, 6, 7, 8], params))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])  # skip the prefill steps


def seconds_per_request(batch: int, steps: int = 2000) -> float:
    """``observe_step`` of a decode batch in mid-generation (the common step), per request."""
    stats = EngineStats()
    outputs, sequences = [], []
    for i in range(batch):
        outputs.append(StepOutput(f"r{i}", [5], [], False))
        sequences.append(SimpleNamespace(last_token_at=0.0, num_output=3, num_prompt=3, arrival_time=0.0,
                                         first_token_time=0.0))
    start = time.perf_counter()
    for step in range(steps):
        stats.observe_step(sequences, outputs, 0.01 * (step + 1))
    return (time.perf_counter() - start) / steps / batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_number_options(parser, batch=64, tokens=32, rounds=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as model_dir:
        make_tiny_model(model_dir)
        config = InferenceConfig(max_requests=args.batch, max_batch_tokens=max(2048, 4 * args.batch),
                                 num_kv_blocks=args.batch * (4 + args.tokens) // 16 + args.batch + 8)
        engine = DynamicInferenceEngine.from_model_dir(model_dir, config)
        with_stats, without = [], []
        for _ in range(args.rounds):  # interleaved, so drift in machine load hits both alike
            engine.stats = EngineStats()
            with_stats.append(seconds_per_step(engine, args.batch, args.tokens))
            engine.stats = NoStats()
            without.append(seconds_per_step(engine, args.batch, args.tokens))
        engine.stats = EngineStats()
        seconds_per_step(engine, args.batch, args.tokens)
        start = time.perf_counter()
        for _ in range(1000):
            engine.metrics_snapshot()
        snapshot = (time.perf_counter() - start) / 1000
    observe = seconds_per_request(args.batch)
    a, b = statistics.median(with_stats), statistics.median(without)
    print(f"device {engine.device}; batch {args.batch}; {args.tokens} tokens per request; median decode step")
    print(f"{'without metrics':>18} {b * 1e3:8.3f} ms")
    print(f"{'with metrics':>18} {a * 1e3:8.3f} ms   ratio {a / b:.3f}   "
          f"({(a - b) / args.batch * 1e6:.2f} us per request per step)")
    print(f"{'per request':>18} {observe * 1e6:8.2f} us (observe_step of a decode batch of {args.batch}; "
          f"{observe * args.batch / b:.2%} of this step)")
    print(f"{'heartbeat snapshot':>18} {snapshot * 1e6:8.1f} us (at most every 0.2 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
