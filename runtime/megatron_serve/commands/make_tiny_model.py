"""``megatron-serve make-tiny-model DIR``: a small random model for demos and tests."""

from __future__ import annotations

import argparse
import sys

from ..model.tiny import ARCHITECTURE_NAMES, MOE_DEFAULTS, make_tiny_model
from .flags import add_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write the model (created if missing)")
    add_flags(parser, "make_tiny_model", ARCHITECTURE_NAMES=sorted(ARCHITECTURE_NAMES))


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
