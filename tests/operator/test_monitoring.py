"""Monitoring and autoscaling artefacts: the chart's ServiceMonitor/PodMonitor and dashboard, and the
examples in ``manifests/examples/monitoring/``.

The HPA is checked by ``kubernetes-validate --strict``; ServiceMonitor, PodMonitor and ScaledObject
by their projects' own CRD schemas (``vendored_crds/``, see its README); every PromQL query (the
dashboard, the adapter rules, KEDA) may only name series that ``/metrics`` really exports, which
is rendered here from a real ``ServerMetrics`` fed an engine's real heartbeat metrics.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from .helpers import ROOT, load_yaml, structural_json_schema
from .test_operator_chart import K8S_VERSION, render_chart

MONITORING = ROOT / "manifests" / "examples" / "monitoring"
VENDORED = Path(__file__).parent / "vendored_crds"
SERIES = re.compile(r"\bmegatron_serve_[a-z0-9_]+")


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> JSON schema of that version, unknown fields forbidden."""
    schemas = {}
    for path in sorted(VENDORED.glob("*.yaml")):
        (crd,) = load_yaml(path)
        for version in crd["spec"]["versions"]:
            api_version = f"{crd['spec']['group']}/{version['name']}"
            schemas[(api_version, crd["spec"]["names"]["kind"])] = structural_json_schema(
                version["schema"]["openAPIV3Schema"])
    return schemas


def crd_errors(obj: dict[str, Any], schemas: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    schema = schemas[(obj["apiVersion"], obj["kind"])]
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in jsonschema.Draft4Validator(schema).iter_errors(obj)]


def exported_names() -> set[str]:
    """Sample names of a server whose fleet has one engine that reported real metrics."""
    from megatron_serve.wire.engine_stats import EngineStats
    from megatron_serve.http_options import WakeOptions
    from megatron_serve.server.metrics import ServerMetrics
    from megatron_serve.server.wake import WakeCollector, WakeGate

    class Monitor:
        reachable = True
        state = "RUNNING"
        status = {"state": "RUNNING", "queued": 1, "in_flight": 2, "epoch": 3, "refits": 1, "engines": [
            {"id": "e0", "group": 0, "running": 2, "waiting": 1, "kv_blocks_free": 3, "kv_blocks_total": 8,
             "epoch": 3, "last_refit": {"verify_s": 0.1, "load_s": 0.2, "total_s": 0.3},
             "metrics": EngineStats().to_wire(prefix_cache_queries=10, prefix_cache_hits=4)}]}
        engines = status["engines"]

        def totals(self) -> dict[str, int]:
            return {"engines": 1, "queued": 1, "in_flight": 2, "kv_blocks_used": 5, "kv_blocks_total": 8,
                    "computed_tokens": 0}

    metrics = ServerMetrics(Monitor(), lambda: 0, "m")  # type: ignore[arg-type]
    metrics.add_collector(WakeCollector(WakeGate(Monitor(), WakeOptions())))  # type: ignore[arg-type] - as the app
    metrics.http_requests.labels("/v1/completions", "200").inc()  # labelled server series appear once used
    text = metrics.render()[0].decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def names_in(query: str) -> set[str]:
    return set(SERIES.findall(query))


# --------------------------------------------------------------------------- examples

def test_hpa_example_is_a_valid_autoscaler_on_the_scale_subresource():
    (hpa,) = load_yaml(MONITORING / "hpa-queue-depth.yaml")
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "serving.megatron.dev/v1alpha1",
                                             "kind": "MegatronInference", "name": "llama-1b"}
    (metric,) = hpa["spec"]["metrics"]
    adapter = yaml.safe_load((MONITORING / "prometheus-adapter-values.yaml").read_text())
    published = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    assert metric["object"]["metric"]["name"] in published  # the adapter publishes what the HPA reads
    assert metric["object"]["describedObject"] == {"apiVersion": "v1", "kind": "Service", "name": "llama-1b"}


def test_a_broken_hpa_is_refused():
    (hpa,) = load_yaml(MONITORING / "hpa-queue-depth.yaml")
    hpa["spec"]["metrics"][0]["object"]["target"]["averageValues"] = "8"  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)


def test_monitor_and_scaledobject_examples_validate_against_their_crds():
    schemas = crd_schemas()
    kinds = []
    for path in sorted(MONITORING.glob("*.yaml")):
        for obj in load_yaml(path):
            if (obj.get("apiVersion"), obj.get("kind")) in schemas:
                assert crd_errors(obj, schemas) == [], path.name
                kinds.append(obj["kind"])
    assert sorted(kinds) == ["PodMonitor", "ScaledObject", "ServiceMonitor"]
    (scaled,) = load_yaml(MONITORING / "keda-scaledobject.yaml")
    assert scaled["spec"]["scaleTargetRef"]["kind"] == "MegatronInference"
    broken = {**scaled, "spec": {**scaled["spec"], "minReplicaCount": "one"}}
    assert crd_errors(broken, schemas)  # the schemas do refuse things


def test_every_query_names_exported_series():
    exported = exported_names()
    queries = []
    board = json.loads((ROOT / "charts" / "megatron-operator" / "dashboards" / "megatron-serve.json").read_text())
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        queries += [target["expr"] for target in panel["targets"]]
    queries += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    adapter = yaml.safe_load((MONITORING / "prometheus-adapter-values.yaml").read_text())
    queries += [part for rule in adapter["rules"]["custom"] for part in (rule["seriesQuery"], rule["metricsQuery"])]
    (scaled,) = load_yaml(MONITORING / "keda-scaledobject.yaml")
    queries += [trigger["metadata"]["query"] for trigger in scaled["spec"]["triggers"]]
    named = set().union(*(names_in(q) for q in queries))
    assert named and named <= exported, sorted(named - exported)
    for title in ("Time to first token", "Queue", "KV-cache usage", "Lifecycle state", "Refits", "Generated tokens / s"):
        assert any(p["title"] == title for p in board["panels"]), title


def test_dashboard_example_is_the_chart_dashboard_in_a_sidecar_configmap():
    (configmap,) = load_yaml(MONITORING / "grafana-dashboard.yaml")
    kubernetes_validate.validate(configmap, K8S_VERSION, strict=True)
    assert configmap["metadata"]["labels"] == {"grafana_dashboard": "1"}
    chart_json = (ROOT / "charts" / "megatron-operator" / "dashboards" / "megatron-serve.json").read_text()
    assert json.loads(configmap["data"]["megatron-serve.json"]) == json.loads(chart_json)


# --------------------------------------------------------------------------- the chart

@pytest.fixture(scope="module")
def helm():
    import helm_python

    return helm_python


def test_chart_renders_monitors_and_dashboard_when_asked(helm):
    values = {"monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                             "podMonitor": {"enabled": True, "interval": "30s"}},
              "grafana": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}}}}
    objects, _ = render_chart(helm, values)
    schemas = crd_schemas()
    monitors = [o for o in objects if o["kind"] in ("ServiceMonitor", "PodMonitor")]
    assert sorted(o["kind"] for o in monitors) == ["PodMonitor", "ServiceMonitor"]
    for monitor in monitors:
        assert crd_errors(monitor, schemas) == []
        assert monitor["spec"]["namespaceSelector"] == {"any": True}
        assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "coordinator"
    service_monitor = next(o for o in monitors if o["kind"] == "ServiceMonitor")
    assert service_monitor["metadata"]["labels"]["release"] == "kps"
    assert service_monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s",
                                                     "scrapeTimeout": "10s"}]
    (configmap,) = [o for o in objects if o["kind"] == "ConfigMap"]
    kubernetes_validate.validate(configmap, K8S_VERSION, strict=True)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    chart_json = (ROOT / "charts" / "megatron-operator" / "dashboards" / "megatron-serve.json").read_text()
    assert json.loads(configmap["data"]["megatron-serve.json"]) == json.loads(chart_json)


def test_chart_monitors_follow_the_watched_namespaces(helm):
    values = {"rbac": {"scope": "namespace"}, "watchNamespaces": ["team-a", "team-b"],
              "monitoring": {"serviceMonitor": {"enabled": True}}}
    objects, _ = render_chart(helm, values, namespace="ops")
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert monitor["metadata"]["namespace"] == "ops"


def test_chart_defaults_render_no_monitoring_objects(helm):
    objects, _ = render_chart(helm, {})
    assert not [o for o in objects if o["kind"] in ("ServiceMonitor", "PodMonitor", "ConfigMap")]
    with helm.Chart.load(str(ROOT / "charts" / "megatron-operator")) as chart:
        with pytest.raises(Exception):
            chart.validate_schema({"monitoring": {"serviceMonitor": {"interval": "soon"}}})

