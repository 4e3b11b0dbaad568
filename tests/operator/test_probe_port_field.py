"""``spec.server.probePort`` reaches the server command as ``--health-port`` (parsed back by the server's own
parser), the pod's liveness and readiness probes use it, no Service or pod reaches it, and 0 puts the probes back
on the HTTP port."""

from __future__ import annotations

import pytest

from megatron_operator import spec
from megatron_operator.network import unauthenticated_ports
from megatron_operator.render import render

from .helpers import ROOT, load_yaml
from .test_operator_render import CONFIG, _containers, _parser_for, by_key, identified


def rendered(probe_port: int | None) -> tuple[dict, dict]:
    """The server container and every rendered object of the single-GPU example with ``probePort`` (None: unset)."""
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "single-gpu.yaml")
    resource["spec"].setdefault("server", {}).pop("probePort", None)
    if probe_port is not None:
        resource["spec"]["server"]["probePort"] = probe_port
    objects = by_key(render(identified(resource), CONFIG))
    (server,) = [c for c in _containers(objects[("Deployment", "llama-1b-coordinator")]) if c["name"] == "server"]
    return server, objects


@pytest.mark.parametrize("probe_port, expected", [(None, 8001), (9100, 9100)])
def test_the_probes_use_the_probe_port(probe_port, expected):
    server, objects = rendered(probe_port)
    command, *args = server["args"]
    parsed, _ = _parser_for(command).parse_known_args(args)
    assert (parsed.port, parsed.health_port) == (8000, expected)
    assert server["readinessProbe"]["httpGet"] == {"path": "/ready", "port": expected}
    assert server["livenessProbe"]["httpGet"] == {"path": "/health", "port": expected}
    # Not a declared port: no Service sends traffic to it, and the NetworkPolicy (which selects the pod) admits no
    # pod to it; the kubelet probes from the node, which policies never block.
    assert [p["containerPort"] for p in server["ports"]] == [8000]
    assert all(p["port"] == 8000 for (kind, _), o in objects.items() if kind == "Service" and o["spec"].get("ports")
               and o["metadata"]["name"] == "llama-1b" for p in o["spec"]["ports"])
    assert unauthenticated_ports(list(objects.values())) == []


def test_probe_port_zero_probes_the_http_port():
    server, _objects = rendered(0)
    command, *args = server["args"]
    parsed, _ = _parser_for(command).parse_known_args(args)
    assert parsed.health_port == 0  # the server opens no probe port
    assert server["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert server["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


@pytest.mark.parametrize("server", [{"probePort": 8000}, {"port": 8001}, {"port": 9000, "probePort": 9000}, {"probePort": 5555},
                                    {"probePort": 65536}, {"probePort": -1}])
def test_a_probe_port_that_collides_or_is_no_port_is_refused(server):
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "single-gpu.yaml")
    resource["spec"].setdefault("server", {}).update(server)
    with pytest.raises(spec.SpecError, match="probePort"):
        spec.parse(resource)
