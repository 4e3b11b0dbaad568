"""The benchmark scripts import their siblings (``from serving import ...``, ``from scratch import ...``) as scripts
run from their folder do: tests that load a script as a module need that folder on the path too."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)  # after everything else: a benchmark's name never shadows an installed module
