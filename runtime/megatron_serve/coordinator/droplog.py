"""Rate-limited logging of dropped frames."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("megatron_serve.coordinator")


class DropLog:
    """Logs dropped frames: at most ``per_second`` lines a second, plus the first of each kind.

    A flood of garbage must neither fill the disk nor hide what is happening: beyond the budget
    only a reason not yet seen in this second is logged (so an oversize frame is not hidden by ten
    thousand syntax errors), and the rest are counted in one summary line.
    """

    def __init__(self, per_second: int = 20, max_kinds: int = 50) -> None:
        self.per_second = per_second
        self.max_kinds = max_kinds
        self.window = 0
        self.logged = 0
        self.kinds: set[str] = set()
        self.suppressed = 0
        self.total = 0

    def __call__(self, peer: str, reason: str) -> None:
        self.total += 1
        now = int(time.monotonic())
        if now != self.window:
            self.flush()
            self.window = now
        kind = reason[:24]
        if self.logged < self.per_second or (kind not in self.kinds and len(self.kinds) < self.max_kinds):
            self.logged += 1
            self.kinds.add(kind)
            logger.warning("dropped frame from %s: %s", peer, reason)
        else:
            self.suppressed += 1

    def flush(self) -> None:
        if self.suppressed:
            logger.warning("dropped %d more frames in the last second (log lines suppressed)", self.suppressed)
        self.logged = 0
        self.suppressed = 0
        self.kinds.clear()
