"""A benchmark's scratch directory (a tiny model, a run's logs), removed when the benchmark's process ends, so that a
suite that runs the benchmarks leaves nothing behind in ``$TMPDIR``."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_dir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path
