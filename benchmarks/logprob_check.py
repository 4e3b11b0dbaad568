"""Cost of ``--verify-logprobs-fraction``: offline throughput with the check off, on a tenth, and on every request.

One engine configuration, one model, the same requests (mixed prompt/output lengths, all reporting
log probs, EOS ignored) in the same process, greedy and sampled (temperature 1, 4 samples per prompt
with their own seeds). Each run ends when the engine has nothing left, checks included, so the
ratio against the fraction-0 run in the same process is the whole cost of the checks (each is one
prefill of prompt + completion, queued behind the user requests). Also printed: how many checks
ran and how many found a difference (float32 on CPU without the batch-invariant mode: the last bits
of some tokens differ; see docs/rl-fleets.md).

    python benchmarks/logprob_check.py [--hidden-size 256 --layers 4 --requests 32]

Measured with the defaults (float32, 2-core CPU shared with other jobs, load average 10-13, so
+-15% between runs of the same setting), generated tokens per CPU second against fraction 0:
greedy 0.1 -> 1.11x (noise), 1.0 -> 0.43x; temperature 1 with n 4: 0.1 -> 0.79x, 1.0 -> 0.69x.
Every check found a difference (float32 without the batch-invariant mode). On a CPU a step's cost
follows the rows it computes, and a check computes prompt + completion again without the prefix
cache, so checking every request about doubles the rows; a fraction F adds about F times that.
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.model.tiny import make_tiny_model

FRACTIONS = (0.0, 0.1, 1.0)


def workload(vocab_size: int, count: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(5, vocab_size) for _ in range(rng.randint(16, 128))], rng.randint(16, 64))
            for _ in range(count)]


def run(model_dir: str, fraction: float, requests: list[tuple[list[int], int]], sampled: bool) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds, the engine's counters) for every request and every check to finish."""
    engine = DynamicInferenceEngine.from_model_dir(model_dir, InferenceConfig(
        dtype="float32", verify_logprobs_fraction=fraction, max_requests=64, max_batch_tokens=1024))
    samples = 4 if sampled else 1
    started, cpu = time.perf_counter(), time.process_time()
    for i, (prompt, tokens) in enumerate(requests):
        for s in range(samples):
            params = SamplingParams(temperature=1.0 if sampled else 0.0, seed=i * samples + s if sampled else None,
                                    num_tokens_to_generate=tokens, ignore_eos=True, return_log_probs=True)
            engine.add_request(DynamicInferenceRequest(f"r{i}-{s}", None, prompt, params))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started, time.process_time() - cpu, dict(engine.stats.counters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    logging.getLogger("megatron_serve.engine.sampling.logprob_parity").setLevel(logging.ERROR)  # one warning per mismatch
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(tmp, seed=0, hidden_size=args.hidden_size, num_layers=args.layers,
                                        num_heads=8, num_kv_heads=4, max_position_embeddings=1024))
        requests = workload(512, args.requests, seed=1)
        run(model_dir, 0.0, requests[:4], sampled=False)  # warm-up: allocator, kernels
        print("| sampling | fraction | wall s | CPU s | tokens per CPU s | vs fraction 0 | checked | mismatched |")
        print("|---|---|---|---|---|---|---|---|")
        for sampled in (False, True):
            base = None
            for fraction in FRACTIONS:
                wall, cpu, counters = run(model_dir, fraction, requests, sampled)
                rate = counters["generation_tokens"] / cpu  # CPU time: the machine may be shared
                base = base or rate
                print(f"| {'temperature 1, n 4' if sampled else 'greedy'} | {fraction} | {wall:.2f} | {cpu:.2f} | "
                      f"{rate:.0f} | {rate / base:.2f}x | {counters['logprob_parity_checked']} | "
                      f"{counters['logprob_parity_mismatch']} |")


if __name__ == "__main__":
    main()
