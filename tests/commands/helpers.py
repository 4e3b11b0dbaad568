"""What the command tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_serve.cli import parse_args


def run_refuses(model_dir: Path, argv: list[str], problem: str) -> None:
    """``megatron-serve run --model MODEL_DIR ARGV`` is refused with a ``ValueError`` matching ``problem`` before it
    starts anything (``model_dir`` need hold no model: the layout is checked first)."""
    from megatron_serve.commands import run  # noqa: PLC0415 - the command's module, as the CLI imports it

    with pytest.raises(ValueError, match=problem):
        run.run(parse_args(["run", "--model", str(model_dir), *argv]))
