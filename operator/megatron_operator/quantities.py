"""Kubernetes quantities compared by value, for :mod:`.reconcile`'s "does the live object hold what we render".

The API server stores a quantity in its canonical form: ``"0.5"`` CPU comes back as ``"500m"``, ``"1000m"`` as
``"1"``, ``"2048Mi"`` as ``"2Gi"``. A resource that spells its quantities otherwise renders children whose text
never matches the live ones, so every pass patched the workloads again and posted an ``Updated`` Event, every
reconcile interval, for ever (a real kube-apiserver showed it; the emulator stores what it is given). Compared by
value, the live workload holds the rendered one and the pass writes nothing.
"""

from __future__ import annotations

from typing import Any

#: Keys whose value is a map of quantities (a container's ``resources``).
QUANTITY_MAPS = frozenset({"limits", "requests"})
#: Keys whose value is one quantity (an ``emptyDir``'s size).
QUANTITY_FIELDS = frozenset({"sizeLimit"})


def equal(want: Any, have: Any) -> bool:
    """Whether two quantities (strings or numbers) are the same amount; anything that is not a quantity is not."""
    from kubernetes.utils.quantity import parse_quantity  # noqa: PLC0415 - the client package only when needed

    if isinstance(want, bool) or isinstance(have, bool):
        return False
    try:
        return parse_quantity(want) == parse_quantity(have)
    except (ValueError, TypeError):
        return False


def map_contains(want: Any, have: Any) -> bool:
    """Whether the quantity map ``have`` holds every quantity of ``want``, by value."""
    if not isinstance(want, dict) or not isinstance(have, dict):
        return False
    return all(name in have and equal(value, have[name]) for name, value in want.items())
