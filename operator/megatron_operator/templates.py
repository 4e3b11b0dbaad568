"""Which pod template an engine group's workload runs, and the patch that gives it exactly the rendered one.

The reconciler's patches are JSON merge patches computed from what the rendered object holds: a key the live object
has and the rendering does not is left alone, so that server-side defaults never cause a write. For a pod template
that is wrong: a key removed from the spec (a nodeSelector entry, a resource limit, an environment variable's
field) would stay, and reverting a bad rollout by removing what it added would change nothing. So a workload carries
the hash of the template it was given (:data:`TEMPLATE_HASH`); when the rendered template's hash differs, the
patch also removes every map key of the live template the rendering lacks (the API server then fills its defaults
in again), and records the new hash.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from . import crd

#: The hash of the rendered pod template the workload was last given (sha256 of its canonical JSON, 16 hex digits).
TEMPLATE_HASH = f"{crd.GROUP}/template-hash"


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def recorded_hash(live: dict[str, Any]) -> str | None:
    return ((live.get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_HASH)


def exact(want: Any, have: Any) -> Any:
    """The merge patch that turns ``have`` into ``want`` where both are maps: ``want``'s values, and ``None`` (delete)
    for every key only ``have`` holds; anything else is ``want`` itself (lists are replaced whole)."""
    if not isinstance(want, dict) or not isinstance(have, dict):
        return want
    patch: dict[str, Any] = {key: None for key in have if key not in want}
    for key, value in want.items():
        patch[key] = exact(value, have[key]) if key in have else value
    return patch


def mark(patch: dict[str, Any], template: dict[str, Any]) -> None:
    """Record ``template``'s hash in a workload's merge ``patch`` (or in a new object's metadata)."""
    patch.setdefault("metadata", {}).setdefault("annotations", {})[TEMPLATE_HASH] = template_hash(template)
