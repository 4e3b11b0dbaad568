"""The Grafana dashboard of a megatron-serve fleet, built from a short list of panels (``make docs``).

Written twice by ``tools/generate_docs.py``: as the chart's ``dashboards/megatron-serve.json``
(the chart wraps it in a ConfigMap when ``grafana.dashboard.enabled``) and as a ready ConfigMap in
``manifests/examples/monitoring/``. Both carry the label the Grafana sidecar of
kube-prometheus-stack looks for (``grafana_dashboard: "1"``). Every query reads series from the
metric catalogue; a test checks each name against what ``/metrics`` exports.
"""

from __future__ import annotations

from typing import Any

import yaml

CHART_FILE = "charts/megatron-operator/dashboards/megatron-serve.json"
EXAMPLE_FILE = "manifests/examples/monitoring/grafana-dashboard.yaml"
UID = "megatron-serve-fleet"
SIDECAR_LABEL = {"grafana_dashboard": "1"}

ENGINE = '{namespace=~"$namespace",model_name=~"$model_name"}'  # engine series: labelled by model
FLEET = '{namespace=~"$namespace"}'  # fleet series: one coordinator per resource
RATE = "[$__rate_interval]"


def _quantiles(histogram: str) -> list[tuple[str, str]]:
    return [(f"p{q}", f"histogram_quantile(0.{q}, sum by (le) (rate({histogram}_bucket{ENGINE}{RATE})))")
            for q in (50, 90, 99)]


# (title, unit, [(legend, query)], width): rows of 24 columns, in reading order
PANELS: list[tuple[str, str, list[tuple[str, str]], int]] = [
    ("Generated tokens / s", "short", [
        ("{{model_name}} generated", f"sum by (model_name) (rate(megatron_serve_generation_tokens_total{ENGINE}{RATE}))"),
        ("{{model_name}} prompt", f"sum by (model_name) (rate(megatron_serve_prompt_tokens_total{ENGINE}{RATE}))"),
    ], 8),
    ("Finished requests / s", "reqps", [
        ("{{finished_reason}}", f"sum by (finished_reason) (rate(megatron_serve_request_success_total{ENGINE}{RATE}))"),
    ], 8),
    ("Lifecycle state", "short", [
        ("{{state}}", f"max by (state) (megatron_serve_lifecycle_state{FLEET})"),
    ], 8),
    ("Time to first token", "s", _quantiles("megatron_serve_time_to_first_token_seconds"), 12),
    ("Inter-token latency", "s", _quantiles("megatron_serve_inter_token_latency_seconds"), 12),
    ("End-to-end latency", "s", _quantiles("megatron_serve_e2e_request_latency_seconds"), 12),
    ("Queue time", "s", _quantiles("megatron_serve_request_queue_time_seconds"), 12),
    ("Queue", "short", [
        ("coordinator queue", f"sum(megatron_serve_queue_depth{FLEET})"),
        ("waiting in engine group {{engine_group}}", f"sum by (engine_group) (megatron_serve_num_requests_waiting{ENGINE})"),
        ("running in engine group {{engine_group}}", f"sum by (engine_group) (megatron_serve_num_requests_running{ENGINE})"),
    ], 12),
    ("KV-cache usage", "percentunit", [
        ("engine group {{engine_group}}", f"max by (engine_group) (megatron_serve_kv_cache_usage_perc{ENGINE})"),
    ], 12),
    ("Prefix-cache hit rate", "percentunit", [
        ("{{model_name}}", f"sum by (model_name) (rate(megatron_serve_prefix_cache_hits_total{ENGINE}{RATE})) / "
                           f"sum by (model_name) (rate(megatron_serve_prefix_cache_queries_total{ENGINE}{RATE}))"),
    ], 8),
    ("Preemptions / s", "short", [
        ("engine group {{engine_group}}", f"sum by (engine_group) (rate(megatron_serve_num_preemptions_total{ENGINE}{RATE}))"),
    ], 8),
    ("Engine groups", "short", [
        ("registered", f"sum(megatron_serve_engines{FLEET})"),
        ("coordinator reachable", f"min(megatron_serve_coordinator_reachable{FLEET})"),
    ], 8),
    ("Refits", "short", [
        ("refits in range", f"sum(increase(megatron_serve_refits_total{FLEET}[$__range]))"),
        ("weights epoch", f"max(megatron_serve_weights_epoch{FLEET})"),
    ], 8),
    ("Last refit per engine", "s", [
        ("group {{group}} {{phase}}", f"max by (group, phase) (megatron_serve_engine_refit_seconds{FLEET})"),
    ], 8),
    ("HTTP answers / s", "reqps", [
        ("{{code}} {{route}}", f"sum by (code, route) (rate(megatron_serve_http_requests_total{FLEET}{RATE}))"),
    ], 8),
]


def _panel(index: int, x: int, y: int, title: str, unit: str, targets: list[tuple[str, str]], width: int,
           ) -> dict[str, Any]:
    kind = "state-timeline" if title == "Lifecycle state" else "timeseries"
    panel: dict[str, Any] = {
        "id": index + 1,
        "type": kind,
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (legend, expr) in enumerate(targets)],
    }
    if unit == "percentunit":
        panel["fieldConfig"]["defaults"].update({"min": 0, "max": 1})
    return panel


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2, "includeAll": True,
            "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "sort": 1}


def dashboard() -> dict[str, Any]:
    panels, x, y = [], 0, 0
    for index, (title, unit, targets, width) in enumerate(PANELS):
        if x + width > 24:
            x, y = 0, y + 8
        panels.append(_panel(index, x, y, title, unit, targets, width))
        x += width
    return {
        "uid": UID,
        "title": "megatron-serve fleet",
        "description": "Throughput, latency percentiles, queues, KV-cache usage, lifecycle state and refits of "
                       "megatron-serve fleets (MegatronInference resources).",
        "tags": ["megatron-serve", "llm", "inference"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            _variable("namespace", "Namespace", "label_values(megatron_serve_engines, namespace)"),
            _variable("model_name", "Model", "label_values(megatron_serve_num_requests_running, model_name)"),
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def configmap_yaml(board: dict[str, Any]) -> str:
    import json  # noqa: PLC0415

    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "megatron-serve-dashboard", "namespace": "monitoring", "labels": dict(SIDECAR_LABEL)},
        "data": {"megatron-serve.json": json.dumps(board, indent=2) + "\n"},
    }
    header = ("# Generated by `make docs` (tools/dashboard.py); do not edit. The Grafana sidecar of\n"
              "# kube-prometheus-stack loads ConfigMaps labelled grafana_dashboard=\"1\" (namespace: where it looks).\n")
    return header + yaml.safe_dump(configmap, sort_keys=False, width=120)
