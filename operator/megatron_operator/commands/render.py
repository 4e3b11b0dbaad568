"""``megatron-serve render -f FILE``: print the child objects the operator would create."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..render import add_render_arguments

    add_render_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ..cli import render_command

    return render_command(args.filename, token_key_file=args.token_key_file, strict_security=args.strict_security,
                          leader_worker_set=args.leader_worker_set)
