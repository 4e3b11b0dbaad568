"""The engine alone: the 48 choices of a scored 1,000-token prompt, with a two-token request added every few steps,
with ``--long-prefill-token-threshold`` at its default and off (0), alternately in one process (issue 55).

Prints, for each: steps and seconds until every request finished, tokens computed per step, and the short
requests' latency in steps and milliseconds (p50, max). No HTTP server, coordinator or client beside it, so the
scheduler's share of ``benchmarks/request_budget.py``'s figures shows alone.

    python benchmarks/long_prefill_fairness.py [--rounds 2] [--every 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine
from megatron_serve.model.tiny import make_tiny_model
from scratch import scratch_dir

PROMPT = [5 + i % 400 for i in range(1000)]
SCORED = SamplingParams(temperature=0.0, num_tokens_to_generate=16, ignore_eos=True, return_log_probs=True,
                        return_prompt_log_probs=True, top_n_logprobs=20)
SHORT = SamplingParams(temperature=0.0, num_tokens_to_generate=2, ignore_eos=True)


def play(engine: DynamicInferenceEngine, every: int) -> dict[str, float]:
    """The 48 choices, and a short request every ``every`` steps until they are done; the figures."""
    for index in range(48):
        engine.add_request(DynamicInferenceRequest(request_id=f"choice{index}", prompt=None, prompt_tokens=PROMPT,
                                                   sampling_params=SCORED))
    added: dict[str, tuple[int, float]] = {}
    latencies: list[tuple[int, float]] = []
    computed = engine.load().computed_tokens
    steps, started = 0, time.perf_counter()
    choices_left = 48
    while engine.has_unfinished_requests():
        if choices_left and steps % every == 0:
            name = f"short{steps}"
            added[name] = (steps, time.perf_counter())
            engine.add_request(DynamicInferenceRequest(request_id=name, prompt=None, prompt_tokens=[11, 12, 13],
                                                       sampling_params=SHORT))
        outputs = engine.step()
        steps += 1
        for out in outputs:
            if out.finished and out.request.request_id in added:
                step, at = added.pop(out.request.request_id)
                latencies.append((steps - step, time.perf_counter() - at))
            elif out.finished:
                choices_left -= 1
    seconds = time.perf_counter() - started
    return {"steps": steps, "seconds": seconds, "tokens_per_step": (engine.load().computed_tokens - computed) / steps,
            "short": len(latencies), "p50_steps": statistics.median(s for s, _ in latencies),
            "max_steps": max(s for s, _ in latencies), "p50_ms": statistics.median(t for _, t in latencies) * 1000,
            "max_ms": max(t for _, t in latencies) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternating")
    parser.add_argument("--every", type=int, default=3, help="steps between two short requests")
    args = parser.parse_args()
    model = str(make_tiny_model(scratch_dir("bench-tiny-") / "tiny", max_position_embeddings=2048))
    engines = {label: DynamicInferenceEngine.from_model_dir(model, InferenceConfig(long_prefill_token_threshold=value))
               for label, value in (("threshold 512 (default)", None), ("threshold 0 (off)", 0))}
    for round_index in range(args.rounds):
        for label, engine in engines.items():
            figures = play(engine, args.every)
            print(f"round {round_index + 1}, {label}: {figures['steps']} steps, {figures['seconds']:.1f} s, "
                  f"{figures['tokens_per_step']:.0f} tokens a step; {figures['short']} short requests: "
                  f"p50 {figures['p50_steps']:.0f} steps / {figures['p50_ms']:.0f} ms, "
                  f"max {figures['max_steps']} steps / {figures['max_ms']:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
