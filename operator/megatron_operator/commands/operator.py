"""``megatron-serve operator [kopf run options]``: run the Kubernetes operator (kopf).

Extra arguments (``--standalone``, ``-A``, ``--namespace NS``, ``--verbose``, ...) pass through
to ``kopf run``; without a namespace option the whole cluster is served.
"""

from __future__ import annotations

import argparse

ACCEPTS_EXTRA_ARGS = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # No arguments of our own: everything after `operator` reaches `kopf run` unchanged, in order,
    # through the CLI's extra arguments (ACCEPTS_EXTRA_ARGS).
    parser.epilog = ("All options are passed to `kopf run`, e.g. --standalone, -A/--all-namespaces, "
                     "-n/--namespace NS, --verbose, --liveness=http://0.0.0.0:8080/healthz.")


def run(args: argparse.Namespace) -> int:
    from ..cli import operator_command

    return operator_command(list(getattr(args, "extra_args", [])))
