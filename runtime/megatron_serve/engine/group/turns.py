"""What the data-parallel attention ranks agree on at each turn of their step loops (:mod:`.data_parallel`), in
a module without torch: the engine process and the engines that stand in for one in tests share these types."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from ...wire.controls import Refit


class Turn(NamedTuple):
    """What the data-parallel ranks agreed for one turn of their step loops."""

    step: bool  # some rank has work: every rank steps
    verb: bool  # every rank holds a verb that joins them all (:class:`HeldVerb`): every rank acts on it now
    change: bool = False  # the leader saw a planned change asked for (.membership): every rank takes it now


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

