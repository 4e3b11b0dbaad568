"""The benchmark scripts loaded as modules for their tests: one module-scoped fixture per script, made here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers import script_module

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def script_fixture(fixture: str, module: str, file: str) -> Any:
    """A module-scoped fixture named ``fixture``: ``benchmarks/FILE`` loaded as the module ``module`` while the test
    module runs (:func:`tests.helpers.script_module`). Assign it to a name in the test module, as pytest finds it."""
    @pytest.fixture(scope="module", name=fixture)
    def loaded() -> Iterator[ModuleType]:
        with script_module(module, BENCHMARKS / file) as script:
            yield script

    return loaded
