"""The Gateway API Inference Extension example (``manifests/examples/gateway/``): an InferencePool and an
HTTPRoute in front of a ``MegatronInference`` fleet.

Each object is validated against its project's published CRD (vendored unchanged in
``vendored_crds/``, see its README) and ours; the pool must select exactly the pods the operator
renders for the OpenAI server, on the port they serve, and the route must send to that pool.
"""

from __future__ import annotations

import copy

from megatron_operator.config import OperatorConfig
from megatron_operator.render import render

from .helpers import ROOT, load_yaml
from .test_monitoring import crd_errors, crd_schemas
from .test_operator_crd import crd_errors as megatron_crd_errors

EXAMPLE = ROOT / "manifests" / "examples" / "gateway" / "inference-pool.yaml"


def objects() -> dict[str, dict]:
    return {obj["kind"]: obj for obj in load_yaml(EXAMPLE)}


def test_pool_and_route_validate_against_the_published_crds():
    schemas = crd_schemas()
    found = objects()
    assert sorted(found) == ["HTTPRoute", "InferencePool", "MegatronInference"]
    assert megatron_crd_errors(found["MegatronInference"]) == []
    for kind in ("InferencePool", "HTTPRoute"):
        assert crd_errors(found[kind], schemas) == [], kind
    broken = copy.deepcopy(found["InferencePool"])
    broken["spec"]["targetPorts"] = [{"port": 8000}]  # the v1alpha2 spelling: refused by the v1 schema
    assert crd_errors(broken, schemas)


def test_the_pool_selects_the_fleets_server_pods_on_their_port_and_the_route_sends_there():
    found = objects()
    fleet, pool, route = found["MegatronInference"], found["InferencePool"], found["HTTPRoute"]
    rendered = render(fleet, OperatorConfig(token_key=b"k"))
    selected = [obj for obj in rendered if obj["kind"] in ("Deployment", "StatefulSet")
                and pool["spec"]["selector"]["matchLabels"].items()
                <= obj["spec"]["template"]["metadata"]["labels"].items()]
    assert [obj["metadata"]["name"] for obj in selected] == [f"{fleet['metadata']['name']}-coordinator"]
    (server,) = [c for c in selected[0]["spec"]["template"]["spec"]["containers"]
                 if any(p["containerPort"] == fleet["spec"]["server"]["port"] for p in c.get("ports", []))]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [fleet["spec"]["server"]["port"]]
    assert "--metrics-compat" not in server.get("args", [])  # the default, vllm: the picker's series are there
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]
