"""``megatron-serve operator [kopf run options]``: run the Kubernetes operator (kopf).

Extra arguments (``--standalone``, ``-A``, ``--namespace NS``, ``--verbose``, ...) pass through
to ``kopf run``; without a namespace option the whole cluster is served.
"""

from __future__ import annotations

import argparse

ACCEPTS_EXTRA_ARGS = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kopf_args", nargs=argparse.REMAINDER, help="options passed to `kopf run`")


def run(args: argparse.Namespace) -> int:
    from ..cli import operator_command

    return operator_command(list(getattr(args, "kopf_args", [])) + list(getattr(args, "extra_args", [])))
