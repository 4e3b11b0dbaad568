"""What the engines' KV tiers need from the pod and the network: the disk tier's volume and the KV events endpoint.

``spec.engine.kvDiskTier`` becomes a volume at :data:`DISK_MOUNT` in every engine pod (an ``emptyDir`` sized as the
tier, or the named PersistentVolumeClaim) and the flags that put the disk tier there. ``spec.engine.kvEvents``
becomes vLLM's ``--kv-events-config`` binding the port on every engine pod, the container ports, a headless Service
that resolves to every engine pod (a gateway's indexer, llm-d's or Dynamo's, subscribes to each engine, not to a
load-balanced address), an ingress rule admitting the subscribers named, and ``status.kvEvents``. Pure: the render
and the reconcile pass call it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .crd_kv_tiers import KV_EVENTS_PORT
from .names import service
from .spec import InferenceSpec

DISK_VOLUME = "kv-disk"
DISK_MOUNT = "/var/cache/megatron-serve/kv-disk"


def kv_events_service_name(name: str) -> str:
    return f"{name}-kv-events"


def kv_node_flags(spec: InferenceSpec) -> list[str]:
    """The engines' flags of the disk tier and the events (none without the fields: existing pods do not roll)."""
    flags: list[str] = []
    disk = spec.kv_disk_tier
    if disk is not None:
        flags += ["--kv-offloading-backend", "disk", "--kv-disk-dir", DISK_MOUNT, "--kv-disk-size",
                  f"{float(disk['size']):g}"]
    events = spec.kv_events
    if events is not None:
        config: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                  "endpoint": f"tcp://*:{events.get('port', KV_EVENTS_PORT)}"}
        if "replayPort" in events:
            config["replay_endpoint"] = f"tcp://*:{events['replayPort']}"
        if events.get("topic"):
            config["topic"] = events["topic"]
        flags += ["--kv-events-config", json.dumps(config, sort_keys=True)]
    return flags


def disk_volume(spec: InferenceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The engine pods' volume and mount of the disk tier (none without ``kvDiskTier``)."""
    disk = spec.kv_disk_tier
    if disk is None:
        return [], []
    if "claimName" in disk:
        source: dict[str, Any] = {"persistentVolumeClaim": {"claimName": disk["claimName"]}}
    else:
        source = {"emptyDir": {"sizeLimit": f"{math.ceil(float(disk['size']) * 1024)}Mi"}}
    return [{"name": DISK_VOLUME, **source}], [{"name": DISK_VOLUME, "mountPath": DISK_MOUNT}]


def _ports(spec: InferenceSpec) -> list[tuple[str, int]]:
    events = spec.kv_events
    if events is None:
        return []
    ports = [("kv-events", int(events.get("port", KV_EVENTS_PORT)))]
    if "replayPort" in events:
        ports.append(("kv-replay", int(events["replayPort"])))
    return ports


def events_container_ports(spec: InferenceSpec) -> list[dict[str, Any]]:
    return [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in _ports(spec)]


def events_ingress(spec: InferenceSpec) -> list[dict[str, Any]]:
    """The engine policy's rule admitting ``kvEvents.subscribers`` to the events ports (none when none named)."""
    subscribers = (spec.kv_events or {}).get("subscribers") or []
    if not subscribers:
        return []
    return [{"from": [dict(peer) for peer in subscribers],
             "ports": [{"protocol": "TCP", "port": port} for _, port in _ports(spec)]}]


def render_events_service(spec: InferenceSpec) -> dict[str, Any] | None:
    """The headless Service listing every engine pod's events ports (None without ``kvEvents``)."""
    if spec.kv_events is None:
        return None
    return service(spec, kv_events_service_name(spec.name), "engine",
                   [{"name": name, "port": port, "targetPort": port} for name, port in _ports(spec)], headless=True)


def events_status(spec: InferenceSpec) -> dict[str, Any] | None:
    """``status.kvEvents``: where a subscriber finds the engines' events (None without ``kvEvents``). The Service is
    headless: its name resolves to every ready engine pod, and a subscriber connects to each (ZeroMQ connects to one
    address per socket connect)."""
    events = spec.kv_events
    if events is None:
        return None
    status: dict[str, Any] = {"service": f"{kv_events_service_name(spec.name)}.{spec.namespace}.svc",
                              "port": int(events.get("port", KV_EVENTS_PORT)), "topic": events.get("topic", "")}
    if "replayPort" in events:
        status["replayPort"] = int(events["replayPort"])
    return status
