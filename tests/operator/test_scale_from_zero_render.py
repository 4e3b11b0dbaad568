"""spec.server.scaleFromZero in the rendered server container: off by default (no flag, the server's own default:
without engines the pod is not Ready), and when on the server's holding flags, which the runtime's parser takes, so
that a fleet KEDA scales to zero keeps a Ready server pod whose Service sends it the request that wakes the fleet."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from megatron_operator.crd import spec_schema
from megatron_operator.render import render

from .helpers import ROOT, load_yaml
from .test_operator_render import CONFIG, _containers, _parser_for, identified


def server_container(**server: Any) -> dict[str, Any]:
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "single-gpu.yaml")
    resource = copy.deepcopy(resource)
    resource["spec"].setdefault("server", {}).update(server)
    deploy = next(o for o in render(identified(resource), CONFIG)
                  if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-coordinator"))
    return next(c for c in _containers(deploy) if c["name"] == "server")


def test_holding_is_off_by_default_and_the_pod_template_unchanged():
    args = server_container()["args"]
    assert not any(a.startswith("--scale-from-zero") for a in args)
    parsed, _ = _parser_for("server").parse_known_args(args[1:])
    assert parsed.scale_from_zero_timeout == 0


def test_scale_from_zero_passes_the_servers_holding_flags_and_keeps_ready_as_the_readiness_probe():
    server = server_container(scaleFromZero={"timeoutSeconds": 600, "queue": 64})
    args = server["args"]
    assert args[args.index("--scale-from-zero-timeout") + 1] == "600"
    assert args[args.index("--scale-from-zero-queue") + 1] == "64"
    parsed, unknown = _parser_for("server").parse_known_args(args[1:])
    assert unknown == [] and parsed.scale_from_zero_timeout == 600 and parsed.scale_from_zero_queue == 64
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"


@pytest.mark.parametrize("holding", [{"timeoutSeconds": 0}, {"timeoutSeconds": 0, "queue": 8}])
def test_timeout_zero_is_off(holding):
    assert not any(a.startswith("--scale-from-zero") for a in server_container(scaleFromZero=holding)["args"])


def test_the_crd_defaults_it_off_and_bounds_it():
    holding = spec_schema()["properties"]["server"]["properties"]["scaleFromZero"]["properties"]
    assert holding["timeoutSeconds"]["default"] == 0 and holding["timeoutSeconds"]["minimum"] == 0
    assert holding["queue"]["default"] == 256 and holding["queue"]["minimum"] == 0
