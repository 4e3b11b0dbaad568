"""``megatron-serve control scale-ep --size N``: the verb spelled with a hyphen is the table's ``scale_ep``, and a 0
given to an integer option is given (it was taken for absent, so ``--size 0`` went unrefused and ``--epoch 0``
was dropped)."""

from __future__ import annotations

import argparse

import pytest

from megatron_serve.commands import control


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    control.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_scale_ep_with_a_hyphen_is_the_tables_verb_and_takes_its_size():
    args = parse("scale-ep", "--size", "3")
    assert args.verb == "scale_ep" and control.verb_arguments(args) == {"size": 3}


def test_a_zero_is_an_option_given():
    with pytest.raises(ValueError, match="scale_ep --size: size must be >= 1, got 0"):
        control.verb_arguments(parse("scale_ep", "--size", "0"))
    assert control.verb_arguments(parse("refit", "--source", "/w", "--epoch", "0")) == {"source": "/w", "epoch": 0}
    with pytest.raises(ValueError, match="--size applies to scale_ep only, not pause"):
        control.verb_arguments(parse("pause", "--size", "0"))
