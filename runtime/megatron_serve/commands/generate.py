"""``megatron-serve generate --model DIR "prompt" ...``: a quick look at a model, in this process."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .engine_options import add_engine_options, inference_config_from_args
from .flags import add_flags
from .inputs import check_model_dir
from .model_options import add_model_options, resolve_model_args

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_options(parser)
    parser.add_argument("prompts", nargs="+", help="one or more prompts")
    add_flags(parser, "generate")
    add_engine_options(parser)


def run(args: argparse.Namespace) -> int:
    from ..generation_config import GenerationDefaults  # noqa: PLC0415

    resolve_model_args(args)
    check_model_dir(args.model, tokenizer=args.tokenizer is None)
    defaults = GenerationDefaults.load(args.generation_config, args.model)
    # This command's own fallbacks (greedy, 32 tokens) sit under the model's defaults and the flags.
    fallback = GenerationDefaults({"temperature": 0.0, "num_tokens_to_generate": 32, **defaults.values})
    params = fallback.sampling_params(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                      num_tokens_to_generate=args.max_tokens, ignore_eos=args.ignore_eos)
    if defaults.values:
        print(defaults.describe(), file=sys.stderr)
    images = [Path(path).read_bytes() for path in args.image]  # a missing file fails before the model loads
    prompts = [{"prompt": p, "images": images} for p in args.prompts] if images else args.prompts
    # torch's import only once every check above has passed: a refused command stays as quick as a usage error
    from ..api.llm import MegatronLLM  # noqa: PLC0415

    started = time.perf_counter()
    print(f"loading model from {args.model} ...", file=sys.stderr, flush=True)
    llm = MegatronLLM(args.model, inference_config_from_args(args), tokenizer=args.tokenizer,
                      generation_config=args.generation_config)
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
