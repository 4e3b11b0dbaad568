"""The drafter's tensors in a policy refit: names under the reserved prefix ``drafter.`` (issue 39, RL).

A trainer that trains a draft model next to the policy sends both in one REFIT: the policy's tensors under
their own names, the drafter's as ``drafter.`` plus their checkpoint name (``WeightSender.send(...,
drafter=...)`` adds the prefix). Every engine applies both under the refit's epoch, so no guess under a new
epoch comes from the old drafter; a refit without ``drafter.`` tensors leaves the drafter stale (it proposes
nothing) until one brings them. Policy checkpoints never hold a ``drafter.`` name (Hugging Face models name
their weights ``model.``/``lm_head.``), so the prefix cannot shadow a policy weight.
"""

from __future__ import annotations

from typing import Iterable, Iterator, TypeVar

from .adapters import is_adapter

DRAFTER_PREFIX = "drafter."

T = TypeVar("T")


def is_drafter(name: str) -> bool:
    return name.startswith(DRAFTER_PREFIX)


def policy_only(named: Iterable[tuple[str, T]]) -> Iterator[tuple[str, T]]:
    """The policy's pairs of a refit's stream (what tensor-parallel followers load: the drafter runs on rank 0, and
    so do a group's LoRA adapters, :mod:`.adapters`)."""
    return ((name, value) for name, value in named if not is_drafter(name) and not is_adapter(name))


def drafter_shapes(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """The drafter's ``(checkpoint name, shape)`` pairs among a refit's, unprefixed."""
    return [(name[len(DRAFTER_PREFIX):], tuple(shape)) for name, shape in shapes if is_drafter(name)]
