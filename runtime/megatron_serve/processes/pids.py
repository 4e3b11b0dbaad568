"""Processes named by their PID in a file or a table, which may have died without a word: the disk KV tier's
temporary files, the tenant budgets' rows of running requests, the local runs' records. Each checks the PID it
reads here before it trusts or cleans up what that process left."""

from __future__ import annotations

import os


def process_exists(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's does too): what a lock file or a table row naming a process
    that may have died is checked against."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
