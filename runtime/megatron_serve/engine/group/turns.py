"""A verb the data-parallel attention ranks hold until every one holds its copy (:mod:`.data_parallel`), in a module
without torch: the engine process and the engines that stand in for one in tests share it. What the ranks agree on
at each turn is :class:`~megatron_serve.engine.served.Turn`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ...wire.controls import Refit


@dataclass(frozen=True)
class HeldVerb:
    """A verb held until every data-parallel rank holds its copy (:mod:`.data_parallel` says why); past
    ``deadline`` (the verb's own timeout: the sender has given up by then) it is refused instead."""

    header: Any
    body: Any
    deadline: float

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def refusal(self, epoch: int) -> dict[str, Any]:
        """The acknowledgement of a verb refused at its deadline (the weights of ``epoch`` stay, untouched)."""
        return {"error": "the other data-parallel attention ranks' engines did not get the refit in time",
                "phase": "load", "epoch": epoch, "weights_intact": epoch != -1}


def held(header: Any, body: Any) -> HeldVerb | None:
    """``body`` held until every data-parallel rank holds its copy (the load step of a trainer's refit: its transfer
    group spans every rank), or None for a verb that runs at once."""
    if isinstance(body, Refit) and body.rendezvous is not None and (body.phase or "load") == "load":
        return HeldVerb(header, body, time.monotonic() + body.rendezvous.timeout_s)
    return None

