"""How many of a request's log probs change with what shares its steps, with and without ``--batch-invariant``.

One greedy request (a 40-token prompt, 24 generated tokens, log probs) runs alone, then among 7 and among
63 other requests (random prompts of 8-64 tokens, 24 tokens each), then alone with prefill chunks of
16 tokens (``max_batch_tokens`` 16); its log probs are compared with ``==`` against the run alone. Last, a
``transformers`` model loaded from the same directory scores prompt + completion teacher-forced (with the
mode: ``attn_implementation="megatron_invariant"`` under ``megatron_serve.invariant.batch_invariant()``).
The model is the one a newcomer makes (``megatron-serve make-tiny-model DIR``: seed 0, Llama) unless
``--model`` names another. The numbers in docs/batch-invariance.md come from this script.

    OMP_NUM_THREADS=1 python benchmarks/invariance_counts.py [--model DIR] [--dtype float32 bfloat16]

Exit status 1 when the mode lets a log prob differ.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile

import torch

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.model.tiny import make_tiny_model

TOKENS = 24


def prompts(vocab_size: int, others: int) -> list[list[int]]:
    """The compared request's prompt first (40 tokens), then ``others`` of 8-64 tokens (fixed seeds)."""
    rng = random.Random(1)
    first = [rng.randrange(5, vocab_size) for _ in range(40)]
    return [first] + [[rng.randrange(5, vocab_size) for _ in range(rng.randint(8, 64))] for _ in range(others)]


def run(model_dir: str, dtype: str, invariant: bool, others: int, chunk: int = 2048) -> tuple[list[int], list[float]]:
    """The compared request's tokens and log probs, run with ``others`` other requests in its steps."""
    engine = DynamicInferenceEngine.from_model_dir(model_dir, InferenceConfig(
        dtype=dtype, batch_invariant=invariant, max_batch_tokens=chunk, max_requests=64))
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=TOKENS, ignore_eos=True, return_log_probs=True)
    for index, prompt in enumerate(prompts(engine.model.config.vocab_size, others)):
        engine.add_request(DynamicInferenceRequest(f"r{index}", None, prompt, params))
    tokens: list[int] = []
    log_probs: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request.request_id == "r0":
                tokens += out.new_tokens
                log_probs += out.new_log_probs
    engine.shutdown()
    return tokens, log_probs


def teacher_forced(model_dir: str, dtype: str, invariant: bool, prompt: list[int], tokens: list[int]) -> list[float]:
    """``transformers``' log probs of ``tokens`` after ``prompt``, in one forward."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from megatron_serve.invariant import batch_invariant  # noqa: PLC0415

    extra = {"attn_implementation": "megatron_invariant"} if invariant else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=getattr(torch, dtype), **extra)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad(), batch_invariant() if invariant else contextlib.nullcontext():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    scores = torch.log_softmax(logits.float(), -1)
    return [float(scores[i, token]) for i, token in enumerate(tokens)]


def differ(reference: list[float], other: list[float]) -> str:
    count = sum(a != b for a, b in zip(reference, other))
    if not count:
        return "equal"
    largest = max(abs(a - b) for a, b in zip(reference, other))
    return f"{count} of {len(reference)} differ, up to {largest:.2g}"


def compare(model_dir: str, dtype: str, invariant: bool) -> list[tuple[str, str]]:
    """(what, how many log probs differ from the request alone) for each arrangement."""
    tokens, alone = run(model_dir, dtype, invariant, 0)
    rows = [(f"among {others} other requests", differ(alone, run(model_dir, dtype, invariant, others)[1]))
            for others in (7, 63)]
    rows.append(("prefill chunks of 16 tokens", differ(alone, run(model_dir, dtype, invariant, 0, chunk=16)[1])))
    prompt = prompts(_vocab(model_dir), 0)[0]
    rows.append(("`transformers`' teacher-forced forward",
                 differ(alone, teacher_forced(model_dir, dtype, invariant, prompt, tokens))))
    return rows


def _vocab(model_dir: str) -> int:
    from megatron_serve.model.config import ModelConfig  # noqa: PLC0415

    return ModelConfig.from_dir(model_dir).vocab_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory (default: the model `megatron-serve make-tiny-model` "
                                        "writes)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(make_tiny_model(tmp, seed=0, arch="llama"))
        failed = False
        print("| compared with the request alone | dtype | default | `--batch-invariant` |")
        print("|---|---|---|---|")
        for dtype in args.dtype:
            default, invariant = compare(model_dir, dtype, False), compare(model_dir, dtype, True)
            for (what, plain), (_, mode) in zip(default, invariant):
                print(f"| {what} | {dtype} | {plain} | {mode} |", flush=True)
                failed |= mode != "equal"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
