"""What vLLM's result shape costs: ``LLM.generate`` (``RequestOutput``s) against ``MegatronLLM.generate`` (records).

Both run in one process on one engine (``LLM`` is a ``MegatronLLM`` that groups its records into
``RequestOutput``s afterwards), over the same prompts, alternating A, B, A, B so that a loaded
machine slows both alike. Greedy ``n`` 1, and sampled (temperature 1) ``n`` 4 with ``logprobs=5``,
where the conversion has the most to build (a ``Logprob`` per token and candidate). Prints the
median wall-time ratio and the CPU time of the conversion alone per ``RequestOutput`` and per token.

    python benchmarks/vllm_llm.py [--prompts 64] [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from megatron_serve import LLM, MegatronLLM, SamplingParams
from megatron_serve.client.vllm_outputs import Shaper
from megatron_serve.model.tiny import make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = str(make_tiny_model(tempfile.mkdtemp(prefix="vllm-llm-bench-"), seed=0))
    prompts = [f"Prompt {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(args.prompts)]
    cases = {
        "greedy, n 1": SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True),
        "sampled, n 4, logprobs 5": SamplingParams(temperature=1.0, n=4, seed=1, max_tokens=args.tokens,
                                                   ignore_eos=True, logprobs=5),
    }
    with LLM(model, num_gpu_blocks_override=1024, max_num_seqs=256, enable_prefix_caching=False) as llm:
        for name, params in cases.items():
            llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
            ratios = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                records = MegatronLLM.generate(llm, prompts, params)
                native = time.perf_counter() - started
                started = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                ratios.append((time.perf_counter() - started) / native)
            indices = [i for i in range(len(prompts)) for _ in range(params.n)]
            cpu = time.process_time()
            outputs = Shaper(llm.tokenizer).group_by_prompt(indices, records)
            cpu = time.process_time() - cpu
            tokens = sum(len(r.generated_tokens) for r in records)
            print(f"{name}: LLM / MegatronLLM wall time, median of {args.repeats}: {statistics.median(ratios):.3f} "
                  f"(all: {', '.join(f'{r:.3f}' for r in ratios)}); conversion alone: "
                  f"{cpu / len(outputs) * 1e6:.0f} us CPU per RequestOutput, {cpu / tokens * 1e6:.2f} us per token "
                  f"({len(outputs)} outputs, {tokens} tokens)")


if __name__ == "__main__":
    main()
