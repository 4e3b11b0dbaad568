"""Errors that decide what a process does next, shared by modules that must not import each other."""

from __future__ import annotations


class NoFleet(RuntimeError):
    """A lifecycle verb asked of an engine that runs in this process (direct mode): there is no fleet."""


class ClientNotStarted(RuntimeError):
    """A request to an ``InferenceClient`` that is not started or already closed (the HTTP server answers 503)."""


class EngineGroupLost(RuntimeError):
    """A tensor-parallel rank of this engine group is gone: the group cannot step again.

    The engine process exits on it, so that the coordinator removes the group from routing and
    re-queues its requests (they continue elsewhere from the tokens already generated).
    """


class LeftGroup(Exception):
    """This data-parallel rank left its expert-parallel group in a planned change (``scale-ep``): its requests are
    handed back already, and its engine process ends with 0, as after a STOP's drain."""


class RefitFailed(RuntimeError):
    """A refit that did not complete; says which weights the engine holds now.

    ``replaced``: tensors that were overwritten before it failed (0: the old weights are intact).
    ``incomplete``: names whose new values this engine holds while others are older, left by this
    or an earlier failed refit; while it is non-empty the engine's epoch is -1 (no generation
    describes its weights) and a refit that covers those names makes it whole again.
    """

    def __init__(self, message: str, replaced: int, incomplete: list[str], epoch: int) -> None:
        super().__init__(message)
        self.replaced = replaced
        self.incomplete = incomplete
        self.epoch = epoch

    def facts(self) -> dict[str, object]:
        """The engine's weights after the failure, as the REFIT acknowledgement reports them."""
        return {"epoch": self.epoch, "weights_intact": not self.incomplete, "replaced": self.replaced,
                "incomplete": len(self.incomplete), "incomplete_tensors": self.incomplete[:8]}
