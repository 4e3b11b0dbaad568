"""The schema of the engines' KV tiers, refit policy and KV events (``spec.engine.kvOffloadingSize``, ``kvOnRefit``,
``kvDiskTier``, ``kvEvents``).

Part of the CRD of :mod:`megatron_operator.crd` (which imports this module, never the reverse).

``kvOffloadingSize`` is the runtime's ``--kv-offloading-size`` (GiB of host memory for the prefix cache's host
tier, docs/kv-tiers.md): the engine pods hold that much more memory, so where the resource sets the engine pods'
memory request or limit the operator raises it by the tier's size (:func:`with_host_tier`). The engine refuses the
tier without prefix caching, and the disk tier in a group of more than one rank (tensor or pipeline), so the CRD
refuses those too, naming the field. ``kvOnRefit`` is ``--kv-on-refit``: what a resume does with the KV
that a suspend with ``keep_kv`` (``spec.suspendKeepKV``) kept when a refit came in between.

``kvDiskTier`` puts the node's disk tier behind the host tier (``--kv-offloading-backend disk``): a volume mounted
into the engine pods, an ``emptyDir`` of the tier's size (the pod's engines, across restarts) or a
PersistentVolumeClaim (every pod that mounts it on the node). ``kvEvents`` publishes the engines' KV events
(``--kv-events-config``) on a port of every engine pod, behind a headless Service a gateway's indexer subscribes
through (:mod:`megatron_operator.kv_node` renders both).
"""

from __future__ import annotations

import math
from typing import Any

from .crd_rules import CelCheck, one_rank_groups_rule

#: The engines' ZeroMQ port for KV events unless kvEvents.port says otherwise (vLLM's default endpoint's).
KV_EVENTS_PORT = 5557
RENDEZVOUS_PORT = 29500  # names.RENDEZVOUS_PORT: the engines' own port, which kvEvents must leave alone

#: The engines' --kv-on-refit values (megatron_serve.wire.lifecycle.KV_ON_REFIT; a test keeps them equal).
KV_ON_REFIT = ["recompute", "keep"]


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
        "kvDiskTier": {
            "type": "object", "required": ["size"],
            "description": "The node's disk tier of the KV cache behind the host tier (--kv-offloading-backend disk; "
                           "docs/kv-tiers.md): blocks the host tier evicts go to files that every engine sharing the "
                           "volume reads back instead of recomputing; checked before use. Needs kvOffloadingSize. "
                           "Changing it rolls the engine pods.",
            "properties": {
                "size": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                         "description": "GiB the directory holds, every engine's files together (--kv-disk-size; "
                                        "least recently used out first); an emptyDir's sizeLimit."},
                "claimName": {"type": "string", "minLength": 1, "maxLength": 253,
                              "description": "A PersistentVolumeClaim to mount (shared by the pods on a node that "
                                             "mount it; a ReadWriteOnce claim keeps them on one node). Absent: an "
                                             "emptyDir per pod."},
            },
        },
        "kvEvents": {
            "type": "object",
            "description": "Publish the engines' KV events (vLLM's BlockStored, BlockRemoved, AllBlocksCleared over "
                           "ZeroMQ, --kv-events-config; docs/kv-routing.md) for a gateway's KV-aware indexer: every "
                           "engine pod binds the port, a headless Service <name>-kv-events lists them and "
                           "status.kvEvents says where. Changing it rolls the engine pods.",
            "properties": {
                "port": {"type": "integer", "minimum": 1024, "maximum": 65535, "default": KV_EVENTS_PORT,
                         "description": "The PUB socket's port."},
                "replayPort": {"type": "integer", "minimum": 1024, "maximum": 65535,
                               "description": "A ROUTER that returns the batches a subscriber missed (absent: none)."},
                "topic": {"type": "string", "maxLength": 253, "description": "The topic every batch is sent under."},
                "subscribers": {"type": "array", "description": "NetworkPolicy peers admitted to the events ports "
                                                                "(the indexer's pods); the fleet's own engines and "
                                                                "trainers are always. The events carry prompt token "
                                                                "ids: admit only the indexer.",
                                "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            },
        },
    }


def _prefix_caching_rule(engine: dict[str, Any]) -> bool:
    return "kvOffloadingSize" not in engine or bool(engine.get("kvCache", {}).get("prefixCaching", True))


def events_status_schema() -> dict[str, Any]:
    """``status.kvEvents``: where a gateway's indexer subscribes (absent without ``spec.engine.kvEvents``)."""
    return {"type": "object", "description": "Where the engines publish their KV events (spec.engine.kvEvents).",
            "properties": {
                "service": {"type": "string", "description": "Headless Service: resolves to every engine pod; "
                                                             "subscribe to each at port."},
                "port": {"type": "integer", "description": "The PUB socket's port on each engine pod."},
                "replayPort": {"type": "integer", "description": "The replay ROUTER's port (absent: none)."},
                "topic": {"type": "string", "description": "The topic of every batch."},
            }}


def _disk_behind_host_rule(engine: dict[str, Any]) -> bool:
    return "kvDiskTier" not in engine or "kvOffloadingSize" in engine


def _events_ports_rule(engine: dict[str, Any]) -> bool:
    events = engine.get("kvEvents")
    if events is None:
        return True
    ports = [events.get("port", KV_EVENTS_PORT), *([events["replayPort"]] if "replayPort" in events else [])]
    return len(set(ports)) == len(ports) and RENDEZVOUS_PORT not in ports


# (schema path, CEL rule, message, python twin); see crd.CEL_RULES
CEL_RULES: list[tuple[str, str, str, CelCheck]] = [
    (
        "spec.engine",
        "!has(self.kvOffloadingSize) || self.kvCache.prefixCaching",
        "engine.kvOffloadingSize needs engine.kvCache.prefixCaching (the host tier holds cached prefix blocks)",
        _prefix_caching_rule,
    ),
    one_rank_groups_rule("kvDiskTier", "engine.kvDiskTier needs engine groups of one rank: tensor and pipeline "
                                       "parallelism must be 1 (its files hold whole blocks, and each rank of a group "
                                       "holds a part of one; the host tier alone works in a group)"),
    (
        "spec.engine",
        "!has(self.kvDiskTier) || has(self.kvOffloadingSize)",
        "engine.kvDiskTier needs engine.kvOffloadingSize (the disk tier holds what the host tier evicts)",
        _disk_behind_host_rule,
    ),
    (
        "spec.engine",
        f"!has(self.kvEvents) || (self.kvEvents.port != {RENDEZVOUS_PORT} && (!has(self.kvEvents.replayPort) || "
        f"(self.kvEvents.replayPort != self.kvEvents.port && self.kvEvents.replayPort != {RENDEZVOUS_PORT})))",
        f"engine.kvEvents.port and replayPort must differ from each other and from the engines' rendezvous port "
        f"{RENDEZVOUS_PORT}",
        _events_ports_rule,
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
