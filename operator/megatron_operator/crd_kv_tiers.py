"""The schema of the engines' host KV tier and refit policy (``spec.engine.kvOffloadingSize``, ``kvOnRefit``).

Part of the CRD of :mod:`megatron_operator.crd` (which imports this module, never the reverse).

``kvOffloadingSize`` is the runtime's ``--kv-offloading-size`` (GiB of host memory for the prefix cache's host
tier, docs/kv-tiers.md): the engine pods hold that much more memory, so where the resource sets the engine pods'
memory request or limit the operator raises it by the tier's size (:func:`with_host_tier`). The engine refuses the
tier without prefix caching and in a group of more than one rank (tensor, pipeline or data-parallel attention), so
the CRD refuses those too, naming the field. ``kvOnRefit`` is ``--kv-on-refit``: what a resume does with the KV
that a suspend with ``keep_kv`` (``spec.suspendKeepKV``) kept when a refit came in between.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

#: The engines' --kv-on-refit values (megatron_serve.wire.lifecycle.KV_ON_REFIT; a test keeps them equal).
KV_ON_REFIT = ["recompute", "keep"]

CelCheck = Callable[[dict[str, Any]], bool]


def kv_tier_fields() -> dict[str, dict[str, Any]]:
    """``spec.engine``'s fields of the host tier and the refit policy (no defaults: absent fields leave the pod
    templates of existing resources as they were)."""
    return {
        "kvOffloadingSize": {
            "type": "number", "exclusiveMinimum": True, "minimum": 0,
            "description": "GiB of host memory per engine for the KV cache's host tier (--kv-offloading-size, "
                           "vLLM's kv_offloading_size; docs/kv-tiers.md): cached blocks that leave the device pool "
                           "are kept there and copied back instead of recomputed. The engine pods' memory request "
                           "and limit, where spec.engine.resources sets them, are raised by as much. Needs "
                           "kvCache.prefixCaching and engine groups of one rank. Absent: no tier. Changing it "
                           "rolls the engine pods."},
        "kvOnRefit": {
            "type": "string", "enum": list(KV_ON_REFIT),
            "description": "What resuming does with the KV that a suspend with suspendKeepKV kept, when a refit came "
                           "in between (--kv-on-refit): recompute (the engines' default) recomputes every resumed "
                           "request's context under the new weights; keep continues over the old weights' KV (the "
                           "tokens' kv_epochs show it). Changing it rolls the engine pods."},
    }


def _prefix_caching_rule(engine: dict[str, Any]) -> bool:
    return "kvOffloadingSize" not in engine or bool(engine.get("kvCache", {}).get("prefixCaching", True))


def _one_rank_rule(spec: dict[str, Any]) -> bool:
    engine = spec.get("engine", {})
    if "kvOffloadingSize" not in engine:
        return True
    old, new = spec.get("parallelism", {}), engine.get("parallelism", {"tensor": 1, "pipeline": 1})
    return all(int(par.get("tensor", 1)) * int(par.get("pipeline", 1)) == 1 for par in (old, new))


# (schema path, CEL rule, message, python twin); see crd.CEL_RULES
CEL_RULES: list[tuple[str, str, str, CelCheck]] = [
    (
        "spec.engine",
        "!has(self.kvOffloadingSize) || self.kvCache.prefixCaching",
        "engine.kvOffloadingSize needs engine.kvCache.prefixCaching (the host tier holds cached prefix blocks)",
        _prefix_caching_rule,
    ),
    (
        "spec",
        "!has(self.engine.kvOffloadingSize) || (self.parallelism.tensor * self.parallelism.pipeline == 1 "
        "&& (!has(self.engine.parallelism) || self.engine.parallelism.tensor * self.engine.parallelism.pipeline "
        "== 1))",
        "engine.kvOffloadingSize needs engine groups of one rank: tensor and pipeline parallelism must be 1 (the "
        "engine refuses the host tier with them)",
        _one_rank_rule,
    ),
]


def with_host_tier(resources: dict[str, Any], gib: float | None) -> dict[str, Any]:
    """The engine container's ``resources`` with the memory request and limit each raised by ``gib`` GiB, where
    they are set (a pod without them gets none: the tier's memory is the node's to give). Quantities are read as
    Kubernetes reads them and written in the largest binary unit that holds them whole."""
    from kubernetes.utils.quantity import parse_quantity  # noqa: PLC0415 - the client package only when needed

    raised = {kind: dict(values) for kind, values in resources.items()}
    if not gib:
        return raised
    for values in raised.values():
        if isinstance(values, dict) and "memory" in values:
            values["memory"] = _binary_quantity(math.ceil(parse_quantity(values["memory"]) + int(gib * 2**30)))
    return raised


def _binary_quantity(size: int) -> str:
    for suffix, unit in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)
