"""Options of the whole suite: pytest accepts an option from any directory only when the suite's root registers it."""

from __future__ import annotations

import pytest

from .parity.options import add_options


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)
