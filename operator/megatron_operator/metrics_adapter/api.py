"""The documents of ``custom.metrics.k8s.io/v1beta2`` that this adapter answers with, as the Kubernetes API
shapes them (``k8s.io/metrics/pkg/apis/custom_metrics/v1beta2``): discovery, a ``MetricValueList`` and a
``Status`` for a refusal. Pure: no I/O."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from ..crd import GROUP, VERSION
from .rules import MetricRule

API_GROUP = "custom.metrics.k8s.io"
API_VERSION = "v1beta2"
GROUP_VERSION = f"{API_GROUP}/{API_VERSION}"


@dataclass(frozen=True)
class DescribedKind:
    """A kind whose objects the adapter serves metrics for, and how the API names it in a metric's path."""

    resource: str  # ``<plural>.<group>``, or the plural alone for the core group
    kind: str
    api_version: str


#: A MegatronInference, and its Service (named after it: hpa-queue-depth.yaml describes the Service, as the
#: Prometheus adapter's resource overrides publish it).
DESCRIBED = {k.resource: k for k in (
    DescribedKind(f"megatroninferences.{GROUP}", "MegatronInference", f"{GROUP}/{VERSION}"),
    DescribedKind("services", "Service", "v1"),
)}


def group_list() -> dict[str, Any]:
    """``GET /apis``: the one group, as a legacy ``APIGroupList`` (the aggregator falls back to per-version
    discovery for a server without the aggregated kind)."""
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [group()]}


def group() -> dict[str, Any]:
    """``GET /apis/custom.metrics.k8s.io``."""
    version = {"groupVersion": GROUP_VERSION, "version": API_VERSION}
    return {"kind": "APIGroup", "apiVersion": "v1", "name": API_GROUP, "versions": [version],
            "preferredVersion": version}


def resource_list(rules: dict[str, MetricRule]) -> dict[str, Any]:
    """``GET /apis/custom.metrics.k8s.io/v1beta2``: one ``<resource>/<metric>`` entry per kind and metric, as
    ``kubectl get --raw`` lists them for any custom-metrics server."""
    resources = [{"name": f"{resource}/{metric}", "singularName": "", "namespaced": True, "kind": "MetricValueList",
                  "verbs": ["get"]} for resource in DESCRIBED for metric in rules]
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": GROUP_VERSION, "resources": resources}


def quantity(value: float) -> str:
    """A resource.Quantity string: whole numbers as they are, others in thousandths (``2500m``)."""
    if value == int(value):
        return str(int(value))
    return f"{round(value * 1000)}m"


def metric_value_list(kind: DescribedKind, namespace: str, name: str, metric: str, value: float,
                      now: datetime.datetime) -> dict[str, Any]:
    """The answer for one object's metric: a list of one ``MetricValue`` read just now (no window: a gauge)."""
    item = {"describedObject": {"kind": kind.kind, "namespace": namespace, "name": name,
                                "apiVersion": kind.api_version},
            "metric": {"name": metric},
            "timestamp": now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "value": quantity(value)}
    return {"kind": "MetricValueList", "apiVersion": GROUP_VERSION, "metadata": {}, "items": [item]}


REASONS = {400: "BadRequest", 401: "Unauthorized", 404: "NotFound", 503: "ServiceUnavailable"}


def status(code: int, message: str) -> dict[str, Any]:
    """A failed request's ``Status``, which kubectl and the HPA's condition show as the message."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": REASONS[code], "code": code}
