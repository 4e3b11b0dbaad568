"""What a refit's weights go into, as one typed protocol: the policy, its MTP layers, the drafter, the adapter set.

A refit is one transaction over these targets (:meth:`.memory_verbs.DeviceMemory.refit`): every target checks
the source's names and shapes before any weight changes; the source streams once (:func:`route`), each pair to the
target that claims it, the policy taking the rest, live; then every target commits under the new epoch, or none
does when the policy's load failed (what the others held or built is dropped with them). The MTP layers and the
drafter hold their tensors until the commit (they load under the policy's new epoch); the adapter set builds its
new versions before the first policy tensor reaches a live weight (``before_policy``), so that a refused adapter
leaves every weight as it was, and registers them at the commit.

Which speculative targets an engine has follows from its method (:func:`speculative_targets`), never from probing
the proposer: ``mtp`` holds the policy's own MTP layers, ``draft_model`` and ``eagle3`` a drafter that ``drafter.*``
tensors refit (:mod:`..weights.drafter`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol, cast

from ...model.llama import LlamaForCausalLM
from ...model.loader import load_weights
from ...weights.adapters import adapter_shapes, is_adapter, split_name
from ...weights.digests import forget_digests
from ...weights.drafter import DRAFTER_PREFIX, drafter_shapes, is_drafter
from ...weights.sources import WeightSource
from ...wire.rendezvous import LoraPush
from ..lora.adapters import EngineLoras, Registration
from ..speculative.proposer import Proposer

logger = logging.getLogger("megatron_serve.engine")

Named = tuple[str, object]
Shape = tuple[int, ...]


class WeightTarget(Protocol):
    """One holder of weights in a refit."""

    #: its pairs come before the policy's, and :meth:`load` runs before the first policy weight changes
    before_policy: bool

    def claims(self, name: str) -> bool:
        """Whether the refit's tensor ``name`` is this target's (the policy's are whatever no other claims)."""
        ...

    def check(self, source: WeightSource) -> None:
        """``ValueError`` naming the first of the source's tensors of this target that does not fit; touches nothing."""
        ...

    def load(self, pairs: Iterable[Named]) -> None:
        """Take this target's pairs of the stream (the policy: into its live weights; the others: held or built)."""
        ...

    def commit(self, epoch: int) -> str | None:
        """Make what was loaded this target's weights under ``epoch``; returns why that failed, where a failure
        leaves the refit standing (a stale drafter only costs speed)."""
        ...


class ProposerWeights(Protocol):
    """What a proposer that a refit reaches offers: its drafter's (or MTP layers') check and load."""

    def check_weights(self, shapes: Iterable[tuple[str, Shape]]) -> None: ...

    def load_weights(self, named_tensors: Iterable[Named], epoch: int, partial: bool = False) -> None: ...


class MtpWeights(ProposerWeights, Protocol):
    def owns(self, name: str) -> bool: ...


class PolicyTarget:
    """The served model's live weights: the source checks them itself (a directory holds every weight, values are
    read for the finite check); the load copies each tensor in place as it streams; the commit is ``switch``, what
    a new epoch changes in the engine (caches keyed by the old one, the proposer told)."""

    before_policy = False

    def __init__(self, model: LlamaForCausalLM, partial: bool, switch: Callable[[int], None]):
        self.model = model
        self.partial = partial
        self.switch = switch
        self.replaced: set[str] = set()  # the tensors its load overwrote (a failed load reports them)

    def claims(self, name: str) -> bool:
        return True

    def check(self, source: WeightSource) -> None:
        source.check(self.model)

    def load(self, pairs: Iterable[Named]) -> None:
        load_weights(self.model, pairs, progress=self.replaced.add, partial=self.partial)

    def commit(self, epoch: int) -> str | None:
        self.switch(epoch)
        return None


@dataclass(eq=False)  # a target is itself, whatever it holds
class HeldWeights:
    """A proposer's tensors (the MTP layers under their policy names, or the drafter's unprefixed), checked with the
    policy's and held as they stream past, loaded under the policy's new epoch at the commit.

    Their values were verified before any weight changed, as the policy's were; what the commit does is the copy
    into tensors of those shapes, which the policy's load did too and which neither can undo (a rollback would cost
    a second copy of every weight). So a failure there, a fault rather than a bad refit, leaves the policy's refit
    standing and the proposer stale (it proposes nothing, every token is still the policy's) until a refit brings
    its tensors; the refit's answer says so (``drafter_error``), as the log does."""

    before_policy = False

    what: str
    proposer: ProposerWeights | None
    claims: Callable[[str], bool]
    shapes: Callable[[list[tuple[str, Shape]]], list[tuple[str, Shape]]]
    rename: Callable[[str], str]
    model: LlamaForCausalLM
    partial: bool
    held: list[Named] = field(default_factory=list, init=False)

    def check(self, source: WeightSource) -> None:
        wanted = self.shapes(source.shapes())
        if not wanted:
            return
        if self.proposer is None:
            raise ValueError(f"the refit carries {len(wanted)} drafter tensor(s) (e.g. {DRAFTER_PREFIX}{wanted[0][0]}) "
                             "but this engine runs no drafter to refit (speculative method draft_model or eagle3)")
        try:
            self.proposer.check_weights(wanted)
        except ValueError as exc:
            raise ValueError(f"{self.what} tensors do not fit the {self.what}: {exc}") from exc

    def load(self, pairs: Iterable[Named]) -> None:
        self.held.extend((self.rename(name), value) for name, value in pairs)

    def commit(self, epoch: int) -> str | None:
        if not self.held or self.proposer is None:
            return None
        try:
            self.proposer.load_weights(self.held, epoch, partial=self.partial)
        except Exception as exc:  # noqa: BLE001 - speculation only costs speed; the policy's weights are whole
            forget_digests(self.model)  # a later delta must send the drafter's tensors again
            logger.error("refit of the draft model failed, speculation is off until one succeeds: %s", exc)
            return f"the drafter stays stale (it proposes nothing until a refit brings it): {exc}"
        return None


class AdapterTarget:
    """The LoRA adapter versions a sharded refit carries (:mod:`..weights.adapters`): each checked (names, shapes,
    rank, a newer version, room in host memory), built from its tensors before the first policy weight changes,
    registered at the commit, under the policy's epoch."""

    before_policy = True

    def __init__(self, loras: EngineLoras | None, pushes: tuple[LoraPush, ...], live: Callable[[], set[int]]):
        self.loras = loras
        self.pushes = pushes
        self.live = live
        self.built: list[Registration] = []

    def claims(self, name: str) -> bool:
        return is_adapter(name)

    def check(self, source: WeightSource) -> None:
        if not self.pushes:
            return
        if self.loras is None:
            raise ValueError(f"the refit carries LoRA adapter {self.pushes[0].name!r} but this engine runs without "
                             "enable_lora")
        shapes = adapter_shapes(source.shapes())
        live = self.live()
        for push in self.pushes:
            if push.name not in shapes:
                raise ValueError(f"the refit lists LoRA adapter {push.name!r} but carries none of its tensors")
            self.loras.check_push(push, shapes[push.name], live)

    def load(self, pairs: Iterable[Named]) -> None:
        """Every adapter's new version from its received tensors (whole regions: ``value[()]`` reads all)."""
        if not self.pushes:
            return
        held: dict[str, list[Named]] = {}
        for name, value in pairs:
            adapter, peft_name = split_name(name)
            held.setdefault(adapter, []).append((peft_name, value[()]))
        loras, live = cast(EngineLoras, self.loras), self.live()  # checked: a refit with pushes has adapters
        self.built = [loras.prepare(push, held.get(push.name, ()), live) for push in self.pushes]

    def commit(self, epoch: int) -> str | None:
        for entry in self.built:
            cast(EngineLoras, self.loras).register(entry)
        return None


def speculative_targets(method: str | None, proposer: Proposer | None, model: LlamaForCausalLM, partial: bool
                        ) -> list[HeldWeights]:
    """The MTP layers (method ``mtp``) and the drafter (``draft_model``, ``eagle3``; a drafter target without a
    proposer refuses ``drafter.*`` tensors). The method names the proposer's class (:mod:`.speculative.factory`)."""
    drafter = cast(ProposerWeights, proposer) if method in ("draft_model", "eagle3") else None
    targets = [HeldWeights("drafter", drafter, is_drafter, drafter_shapes, lambda name: name[len(DRAFTER_PREFIX):],
                           model, partial)]
    if method == "mtp":
        mtp = cast(MtpWeights, proposer)
        targets.insert(0, HeldWeights("MTP layer", mtp, mtp.owns,
                                      lambda shapes: [(n, tuple(s)) for n, s in shapes if mtp.owns(n)],
                                      lambda name: name, model, partial))
    return targets


def route(named: Iterable[Named], held: list[WeightTarget]) -> Iterator[Named]:
    """Yield the policy's pairs of one stream; every other pair goes to the first of ``held`` that claims it.
    Targets ``before_policy`` load before the first policy pair is yielded (or at the end): an exception there
    stops the refit before any policy weight changed. The others load once the stream ended."""
    pending: dict[int, list[Named]] = {index: [] for index in range(len(held))}
    early = [index for index, target in enumerate(held) if target.before_policy]
    started = False
    for name, value in named:
        index = next((i for i, target in enumerate(held) if target.claims(name)), None)
        if index is None:
            if not started:
                started = True
                for i in early:
                    held[i].load(pending.pop(i))
            yield name, value
        elif started and held[index].before_policy:
            raise ValueError(f"tensor {name!r} arrived after the policy's: adapters travel first")
        else:
            pending[index].append((name, value))
    if not started:
        for i in early:
            held[i].load(pending.pop(i))
    for i, pairs in pending.items():
        held[i].load(pairs)
