"""``megatron-serve render -f FILE``: print the child objects the operator would create."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, metavar="FILE",
                        help="MegatronInference YAML ('-' reads stdin); may hold several documents")


def run(args: argparse.Namespace) -> int:
    from ..cli import render_command

    return render_command(args.filename)
