"""What each engine rank holds of a trainer's last sharded refit, as digests per chunk (a delta compares them).

Kept per model, in the process that holds it, once a sharded refit's load completed (:mod:`.sharded`), and
forgotten by any other weight change (a directory, tensors in this process, a failed load), so that a delta
never skips a chunk this rank does not hold as it was sent.
"""

from __future__ import annotations

import weakref

#: model -> {tensor name: {chunk key: digest}}
_HELD: "weakref.WeakKeyDictionary[object, dict[str, dict[str, str]]]" = weakref.WeakKeyDictionary()


def held_digests(model: object) -> dict[str, dict[str, str]]:
    return _HELD.get(model, {})


def keep_digests(model: object, digests: dict[str, dict[str, str]]) -> None:
    _HELD[model] = digests


def forget_digests(model: object) -> None:
    """The weights changed by another path: no delta may skip anything on this rank."""
    _HELD.pop(model, None)
