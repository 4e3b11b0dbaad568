"""Errors that decide what a process does next, shared by modules that must not import each other."""

from __future__ import annotations


class EngineGroupLost(RuntimeError):
    """A tensor-parallel rank of this engine group is gone: the group cannot step again.

    The engine process exits on it, so that the coordinator removes the group from routing and
    re-queues its requests (they continue elsewhere from the tokens already generated).
    """
