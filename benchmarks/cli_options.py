"""The sizes and counts a benchmark takes on its command line, named once.

Most benchmarks take a dozen options such as ``--prefix-len 512`` or ``--rounds 3`` that have nothing to say but
their default: each written as its own ``add_argument`` call, they were the same line over and over in every script.
An option with a help text, a choice or no default of its own is still added by the script itself."""

from __future__ import annotations

import argparse


def add_number_options(parser: argparse.ArgumentParser, **defaults: int | float) -> None:
    """One ``--name`` option per keyword, in the order given, typed and defaulted by its value: ``prefix_len=512``
    adds ``--prefix-len`` (an ``int``, 512 unless given), read back as ``args.prefix_len`` as argparse names it."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
