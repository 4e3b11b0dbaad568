"""``megatron-serve generate --model DIR "prompt" ...``: a quick look at a model, in this process."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .engine_options import add_engine_options, inference_config_from_args
from .inputs import check_model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("prompts", nargs="+", help="one or more prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--image", action="append", default=[], metavar="FILE",
                        help="an image for every prompt (vision-language models): each prompt holds one image "
                             "placeholder of the model per --image, in order")
    add_engine_options(parser)


def run(args: argparse.Namespace) -> int:
    from ..llm import MegatronLLM  # noqa: PLC0415 - torch import only when generating
    from ..sampling_params import SamplingParams  # noqa: PLC0415

    check_model_dir(args.model)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            num_tokens_to_generate=args.max_tokens, ignore_eos=args.ignore_eos)
    images = [Path(path).read_bytes() for path in args.image]  # a missing file fails before the model loads
    prompts = [{"prompt": p, "images": images} for p in args.prompts] if images else args.prompts
    started = time.perf_counter()
    print(f"loading model from {args.model} ...", file=sys.stderr, flush=True)
    llm = MegatronLLM(args.model, inference_config_from_args(args))
    print(f"loaded in {time.perf_counter() - started:.1f}s; generating", file=sys.stderr, flush=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    for output in outputs:
        print(f"--- {output.prompt!r}")
        print(output.generated_text if output.error is None else f"[failed] {output.error}")
    tokens = sum(len(o.generated_tokens) for o in outputs)
    print(f"{tokens} tokens in {elapsed:.2f}s ({tokens / max(elapsed, 1e-9):.1f} tokens/s)", file=sys.stderr)
    return 0 if all(o.error is None for o in outputs) else 1
