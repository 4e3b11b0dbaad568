"""The parity search's command-line options (registered by ``tests/conftest.py``, so any directory accepts them).

Light on purpose: ``pytest_addoption`` runs before collection, and this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

DEFAULT_CASES = 104
"""Cases per search by default (the engine against ``transformers``, the engine against itself): 13 models, so every
architecture (10) is drawn for 8 cases or more and every slot of the settings' schedule (88) comes once; the same 16
rows as the 200 cases this was before. A nightly or GPU run passes more (``--parity-cases``)."""
INVARIANT_DEFAULT_CASES = 200  # the batch-invariant search takes every 4th seed of these: 50 cases, as before


@dataclass(frozen=True)
class ParityOptions:
    cases: int | None  # cases per search (against transformers; the engine against itself); None: the defaults
    first: int  # seed of the first case: a nightly run can go on where the last one stopped
    only: int | None  # one case, from a failure's reproduction line
    device: str | None  # None: CUDA where there is a GPU, else CPU
    dtype: str

    @property
    def seeds(self) -> list[int]:
        return self.seeds_of(DEFAULT_CASES)

    def seeds_of(self, default: int) -> list[int]:
        """The seeds of a search whose default case count is ``default``."""
        cases = self.cases if self.cases is not None else default
        return [self.only] if self.only is not None else list(range(self.first, self.first + cases))

    def reproduce(self, seed: int) -> str:
        """The options that run case ``seed`` alone, as this run ran it."""
        device = f" --parity-device {self.device}" if self.device else ""
        return f"--parity-seed {seed}{device} --parity-dtype {self.dtype}"

    @classmethod
    def of(cls, config: pytest.Config) -> "ParityOptions":
        return cls(config.getoption("parity_cases"), config.getoption("parity_first"),
                   config.getoption("parity_seed"), config.getoption("parity_device"),
                   config.getoption("parity_dtype"))


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("parity", "parity search (tests/parity)")
    group.addoption("--parity-cases", type=int, default=None, metavar="N",
                    help=f"cases per parity search (default {DEFAULT_CASES}, the batch-invariant search every 4th of "
                         f"{INVARIANT_DEFAULT_CASES}; a nightly or GPU run takes more)")
    group.addoption("--parity-first", type=int, default=0, metavar="SEED",
                    help="seed of the first case (default 0): a longer search can start past the CI's cases")
    group.addoption("--parity-seed", type=int, default=None, metavar="SEED",
                    help="run only case SEED (what a failing case's reproduction line gives)")
    group.addoption("--parity-device", default=None, choices=["cpu", "cuda"],
                    help="device of the engine and of transformers (default: cuda where there is a GPU, else cpu)")
    group.addoption("--parity-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="dtype of the engine and of transformers (default float32)")
