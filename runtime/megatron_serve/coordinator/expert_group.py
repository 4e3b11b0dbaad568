"""SCALE_EP on the coordinator's side: which sizes an expert-parallel group of data-parallel attention ranks can be
asked for (:func:`scale_problem`), and an engine that leaves its group (:func:`leave`). The engines do the change
itself among them (``engine/group/membership.py``); the coordinator only stops routing to the ranks that leave and
resubmits what they hand back, as it does for a drained engine's hand-back, and keeps the size each group is wanted at
(:class:`WantedSizes`, in STATUS), which ``megatron-serve run`` reads to start the ranks a group lacks."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .flow import RequestFlow
    from .peers import EngineRecord
    from .routing import RoutingPolicy

logger = logging.getLogger("megatron_serve.coordinator")


class WantedSizes:
    """The size each expert-parallel group (engine group of data-parallel attention ranks) is wanted at: its
    ``--data-parallel-size`` from its first rank seen, then the size the last SCALE_EP asked for. Kept here because
    only the coordinator sees every SCALE_EP (a ``control`` process sends it); STATUS reports it beside the ranks
    connected, and whoever starts the ranks (``run``'s supervisor) reads it there. It is set when the verb goes to
    the engines, before any rank can leave (so a STATUS read after a rank left never shows the size before), and
    put back when they refused it. A restarted coordinator starts over from the groups' ``--data-parallel-size``, not
    ``scaled``: ``run`` starts ranks only for a size a SCALE_EP asked for, so that such a restart never undoes a
    shrink."""

    def __init__(self) -> None:
        self.wanted: dict[int, int] = {}  # engine group -> data-parallel ranks wanted
        self.full: dict[int, int] = {}  # engine group -> its --data-parallel-size
        self.scaled: set[int] = set()  # the groups whose size a SCALE_EP (to this coordinator) set
        self.before: tuple[dict[int, int], set[int]] = ({}, set())  # both before the SCALE_EP in flight (one at a time)

    def _learn(self, engines: Iterable[EngineRecord]) -> None:
        """Every group of data-parallel attention ranks among ``engines`` is wanted whole until a SCALE_EP says
        otherwise."""
        for engine in engines:
            size = engine.info.get("data_parallel_size")
            if isinstance(size, int) and size > 1 and engine.group not in self.full:
                self.full[engine.group] = self.wanted[engine.group] = size

    def asked(self, engines: Iterable[EngineRecord], size: int) -> None:
        """SCALE_EP to ``size`` goes to every engine: every group is wanted at that size from now on."""
        self._learn(engines)
        self.before = dict(self.wanted), set(self.scaled)
        for group, full in self.full.items():
            self.wanted[group] = min(size, full)
            self.scaled.add(group)

    def refused(self) -> None:
        """The engines refused the SCALE_EP just asked: the sizes wanted before it stand."""
        self.wanted.update(self.before[0])
        self.scaled = self.before[1]

    def describe(self, engines: Iterable[EngineRecord]) -> list[dict[str, Any]]:
        """STATUS's ``expert_groups``: per group, its ``wanted`` size (``scaled``: a SCALE_EP asked for it), its full
        ``size`` and the data-parallel ``ranks`` connected now (a rank that leaves is among them until it exits)."""
        engines = list(engines)
        self._learn(engines)
        return [{"group": group, "wanted": self.wanted[group], "scaled": group in self.scaled, "size": self.full[group],
                 "ranks": sorted(e.info["data_parallel_rank"] for e in engines
                                 if e.group == group and isinstance(e.info.get("data_parallel_rank"), int))}
                for group in sorted(self.full)]


def scale_problem(engines: Iterable[EngineRecord], size: int | None) -> str | None:
    """Why SCALE_EP to ``size`` cannot run: no engine of data-parallel attention is connected, or the size is not one
    its group can have (1 to its ``--data-parallel-size``)."""
    sizes = {engine.info.get("data_parallel_size") for engine in engines} - {None, 1}
    if not sizes:
        return "SCALE_EP needs an expert-parallel group of data-parallel attention ranks (--data-parallel-size > 1)"
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= max(sizes):
        return (f"SCALE_EP size must be an integer in [1, {max(sizes)}] (the group's --data-parallel-size), "
                f"got {size!r}")
    return None


def scale_refused(engines: dict[str, dict[str, Any]]) -> str | None:
    """What refused SCALE_EP, from the engines' acknowledgements (an engine not of an elastic group, say), naming
    the first engine that did; None when none did."""
    refusals = sorted((engine_id, facts["error"]) for engine_id, facts in engines.items() if facts.get("error"))
    if not refusals:
        return None
    more = f" and {len(refusals) - 1} more" if len(refusals) > 1 else ""
    return f"SCALE_EP refused by engine {refusals[0][0]}{more}: {refusals[0][1]}"


def leave(policy: RoutingPolicy, flow: RequestFlow, engine: EngineRecord, handed_back: list[Any]) -> None:
    """``engine`` leaves its expert-parallel group: nothing more is routed to it (``policy`` forgets its caches), and
    the requests it handed back are resubmitted to the others through ``flow`` (what it still holds when it exits is
    resubmitted then, as for any engine gone)."""
    if not engine.draining:
        engine.draining = True
        policy.forget(engine.engine_id)
    flow.hand_back(engine, handed_back, ", leaving its expert-parallel group")
    logger.info("engine %s leaves its expert-parallel group (SCALE_EP): %d request(s) handed back", engine.engine_id,
                len(handed_back))
