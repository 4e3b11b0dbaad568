"""``megatron-serve make-tiny-model DIR``: a small random model for demos and tests."""

from __future__ import annotations

import argparse

from ..tiny_model import ARCHITECTURE_NAMES, make_tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write the model (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weights are a function of the seed")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURE_NAMES), default="llama",
                        help="model family; llava, qwen2_vl and qwen2_5_vl also write an image processor")
    parser.add_argument("--hidden-size", type=int, default=64, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    parser.add_argument("--intermediate-size", type=int, default=128, help="MLP width")


def run(args: argparse.Namespace) -> int:
    path = make_tiny_model(
        args.directory, seed=args.seed, arch=args.arch, hidden_size=args.hidden_size, num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=args.kv_heads, intermediate_size=args.intermediate_size,
    )
    print(f"wrote a tiny {args.arch} model to {path}")
    return 0
