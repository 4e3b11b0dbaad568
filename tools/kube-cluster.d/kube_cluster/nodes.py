"""The fake nodes kwok plays: four GPU nodes in two zones and one CPU-only node.

The labels are the ones real GPU clusters carry and schedulers or operators select on: the
NVIDIA GPU feature discovery's `nvidia.com/gpu.product`/`.count`/`.memory`, the well-known
topology labels, and `type=kwok` with kwok's annotation, which is how kwok picks the nodes it
manages. Capacity is set in the Node object itself (no device plugin runs): 8 GPUs a node, 32 in
all, so that the run's xdist workers can each hold a multi-node gang at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
GPUS_PER_NODE = 8
KWOK_ANNOTATION = "kwok.x-k8s.io/node"


@dataclass(frozen=True)
class FakeNode:
    name: str
    zone: str
    gpus: int


NODES = (
    FakeNode("gpu-node-0", "zone-a", GPUS_PER_NODE),
    FakeNode("gpu-node-1", "zone-a", GPUS_PER_NODE),
    FakeNode("gpu-node-2", "zone-b", GPUS_PER_NODE),
    FakeNode("gpu-node-3", "zone-b", GPUS_PER_NODE),
    FakeNode("cpu-node-0", "zone-a", 0),
)


def manifest(node: FakeNode) -> dict:
    labels = {
        "type": "kwok",
        "kubernetes.io/hostname": node.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "topology.kubernetes.io/region": "local",
        "topology.kubernetes.io/zone": node.zone,
    }
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    if node.gpus:
        labels.update({
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": GPU_PRODUCT,
            "nvidia.com/gpu.count": str(node.gpus),
            "nvidia.com/gpu.memory": "81559",
            "node.kubernetes.io/instance-type": "gpu-8x-h100",
        })
        capacity["nvidia.com/gpu"] = str(node.gpus)
    else:
        labels["node.kubernetes.io/instance-type"] = "cpu-64"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "labels": labels,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {},
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }


def manifests_json() -> str:
    """All nodes as one `kubectl apply -f -` document (a List)."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [manifest(n) for n in NODES]})
