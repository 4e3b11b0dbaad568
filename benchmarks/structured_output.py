"""The throughput cost of constrained decoding: one JSON-schema request in a batch of 32, against none.

Same engine, same prompts, same run: a batch of ``--batch`` requests decoding ``--tokens`` tokens
each (``ignore_eos``, so every request runs its full length), first all free, then with one (or
``--constrained``) of them constrained to a JSON schema whose every value is bounded, and the
constrained request's length fixed by a long string enum so that it keeps decoding the whole time.
Both runs are repeated and the best kept. Prints generated tokens per second and the ratio.

    python benchmarks/structured_output.py --model .models/tiny-llama
    python benchmarks/structured_output.py --model DIR --device cuda --tokens 256 --constrained 4
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.wire.sampling_params import StructuredOutputsParams

# A schema that keeps the constrained request decoding: an array of many bounded records.
SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "name": {"type": "string", "maxLength": 12},
                                     "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}


def run_batch(llm: MegatronLLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[int, float]:
    engine = llm.engine
    requests = [DynamicInferenceRequest(f"r{i}", None, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    elapsed = time.perf_counter() - start
    failed = [r.error for r in requests if r.error]
    if failed:
        raise RuntimeError(f"requests failed: {failed[:2]}")
    return sum(len(r.generated_tokens) for r in requests), elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model directory (e.g. megatron-serve make-tiny-model DIR)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--constrained", type=int, default=1, help="constrained requests in the batch")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each request generates")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    llm = MegatronLLM(args.model, InferenceConfig(device=args.device, max_requests=args.batch))
    prompts = [llm.engine.tokenizer.encode(f"Request {i}: list the records as JSON.") for i in range(args.batch)]
    free = SamplingParams(temperature=1.0, num_tokens_to_generate=args.tokens, ignore_eos=True, seed=0)
    constrained = SamplingParams(temperature=1.0, num_tokens_to_generate=args.tokens, ignore_eos=True, seed=0,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    mixes = {"all free": [free] * args.batch,
             f"{args.constrained} constrained": [constrained] * args.constrained + [free] * (args.batch - args.constrained)}
    run_batch(llm, prompts, mixes["all free"])  # warm-up (and llguidance's vocabulary, built on first use)
    run_batch(llm, prompts, list(mixes.values())[1])
    rates = {}
    for name, params in mixes.items():
        best = 0.0
        for _ in range(args.repeats):
            tokens, elapsed = run_batch(llm, prompts, params)
            best = max(best, tokens / elapsed)
        rates[name] = best
    print(f"device {args.device}; batch {args.batch}; {args.tokens} tokens per request; best of {args.repeats}")
    for name, rate in rates.items():
        print(f"{name:>16}: {rate:10.1f} tokens/s")
    base, mixed = rates.values()
    print(f"{'ratio':>16}: {mixed / base:10.3f} (constrained batch / free batch)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
