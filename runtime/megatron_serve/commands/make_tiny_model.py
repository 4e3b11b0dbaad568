"""``megatron-serve make-tiny-model DIR``: a small random model for demos and tests."""

from __future__ import annotations

import argparse
import sys

from ..model.tiny import ARCHITECTURE_NAMES, MOE_DEFAULTS, make_tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write the model (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weights are a function of the seed")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURE_NAMES), default="llama",
                        help="model family; mixtral, qwen2_moe and qwen3_moe are mixture-of-experts models; llava, "
                             "qwen2_vl and qwen2_5_vl also write an image processor")
    parser.add_argument("--hidden-size", type=int, default=64, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    parser.add_argument("--intermediate-size", type=int, default=128, help="MLP width")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="pad the tokenizer with placeholder tokens to this size (a real model's shape, for "
                             "benchmarks; Llama 3: 128256)")
    parser.add_argument("--tie-word-embeddings", action="store_true", help="the LM head shares the embedding table")
    parser.add_argument("--experts", type=int, default=None,
                        help="experts per layer of a mixture-of-experts arch (default 8)")
    parser.add_argument("--experts-per-token", type=int, default=None,
                        help="experts each token is routed to (default 2)")


def run(args: argparse.Namespace) -> int:
    experts: dict[str, int] = {}
    if args.experts is not None or args.experts_per_token is not None:
        if args.arch not in MOE_DEFAULTS:
            print(f"error: --experts and --experts-per-token need a mixture-of-experts arch "
                  f"({', '.join(sorted(MOE_DEFAULTS))}), not {args.arch!r}", file=sys.stderr)
            return 2
        if args.experts is not None:
            experts["num_local_experts" if args.arch == "mixtral" else "num_experts"] = args.experts
        if args.experts_per_token is not None:
            experts["num_experts_per_tok"] = args.experts_per_token
    path = make_tiny_model(
        args.directory, seed=args.seed, arch=args.arch, hidden_size=args.hidden_size, num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=args.kv_heads, intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size, tie_word_embeddings=args.tie_word_embeddings, **experts,
    )
    print(f"wrote a tiny {args.arch} model to {path}")
    return 0
