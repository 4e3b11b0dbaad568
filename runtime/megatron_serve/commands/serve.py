"""``megatron-serve serve MODEL [options]``: vLLM's spelling of ``megatron-serve run --model MODEL [options]``."""

from __future__ import annotations

import argparse
import functools

from . import run as _run

add_arguments = functools.partial(_run.add_arguments, positional_model=True)


def run(args: argparse.Namespace) -> int:
    return _run.run(args)
