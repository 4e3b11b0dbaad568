"""Who may reach a resource's pods: every container port of every child is covered by a NetworkPolicy, and
``render`` refuses a resource that would leave a port open without credentials.

The coverage test reads the rendered objects the way the API server applies NetworkPolicies (its own
small reading, not the operator's): a policy selects a pod by ``podSelector.matchLabels``; a port is
admitted by the ingress rules that list it (or list no ports); a rule without ``from`` admits everyone.
"""

from __future__ import annotations

import copy
import io
import pathlib
import subprocess
import sys
from typing import Any

import yaml

from megatron_operator import render as rendering
from megatron_operator.config import OperatorConfig
from megatron_operator.network import unauthenticated_ports
from megatron_operator.render import render

from .helpers import ROOT, load_yaml

CONFIG = OperatorConfig(token_key=b"k")
EXAMPLES = ROOT / "manifests" / "examples"
TRAINER = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "rl-trainer"}}}


def pods(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, str], dict[str, Any]]]:
    """(workload name, pod labels, pod spec) of every Deployment and StatefulSet."""
    return [(o["metadata"]["name"], o["spec"]["template"]["metadata"]["labels"], o["spec"]["template"]["spec"])
            for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def admitted_from(objects: list[dict[str, Any]], labels: dict[str, str], port: dict[str, Any]) -> list[Any] | None:
    """The peers admitted to ``port`` of a pod with ``labels`` (``[None]`` in the list: everyone);
    ``None`` when no policy selects the pod (then everything reaches it)."""
    selecting = [o for o in objects if o["kind"] == "NetworkPolicy"
                 and "Ingress" in o["spec"]["policyTypes"]
                 and o["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    if not selecting:
        return None
    peers: list[Any] = []
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            listed = rule.get("ports")
            if listed and not any(p["port"] in (port["containerPort"], port["name"]) for p in listed):
                continue
            peers.extend(rule.get("from") or [None])
    return peers


def test_every_container_port_of_every_example_is_covered_by_a_network_policy(example):
    example = copy.deepcopy(example)
    example["metadata"]["namespace"] = "ml"
    objects = render(example, CONFIG)
    name = example["metadata"]["name"]
    engines = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "megatron-serve",
                                               "app.kubernetes.io/instance": name,
                                               "app.kubernetes.io/component": "engine"}}}
    trainers = example["spec"].get("network", {}).get("trainers", [])
    seen = set()
    for workload, labels, pod in pods(objects):
        for container in pod["containers"]:
            for port in container.get("ports", []):
                seen.add(port["name"])
                peers = admitted_from(objects, labels, port)
                assert peers is not None, f"{workload} {port['name']}: no NetworkPolicy selects the pod"
                assert peers, f"{workload} {port['name']}: a policy selects the pod but admits nothing to it"
                if port["name"] == "http":  # the front door: open, and it takes the API key
                    assert peers == [None]
                    env = {e["name"]: e for e in container["env"]}
                    assert "secretKeyRef" in env["MEGATRON_SERVE_API_KEY"]["valueFrom"], workload
                elif port["name"] == "coordinator":
                    assert None not in peers and peers[0] == engines and peers[3:] == trainers, peers
                    assert all(p["podSelector"]["matchLabels"].get("app.kubernetes.io/instance") in (name, None)
                               for p in peers)
                else:  # the engines' rendezvous (and every other port of theirs): engines and trainers only
                    assert port["name"] == "rendezvous" and labels["app.kubernetes.io/component"] == "engine"
                    assert peers == [engines, *trainers], peers
    assert seen == {"http", "coordinator", "rendezvous"}
    assert unauthenticated_ports(objects) == []


def test_trainers_reach_the_coordinator_and_the_engines_and_nobody_else_does():
    (resource,) = load_yaml(EXAMPLES / "rl-rollout-paused.yaml")
    assert resource["spec"]["network"]["trainers"] == [TRAINER]
    objects = {(o["kind"], o["metadata"]["name"]): o for o in render(resource, CONFIG)}
    coordinator = objects[("NetworkPolicy", "rollout-coordinator")]["spec"]
    engine = objects[("NetworkPolicy", "rollout-engine")]["spec"]
    assert coordinator["ingress"][0]["from"][-1] == TRAINER
    assert coordinator["ingress"][0]["from"][2] == {"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "megatron-operator"}}}
    assert engine["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
    assert "serving.megatron.dev/group" not in engine["podSelector"]["matchLabels"]  # every group's pods
    assert engine["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "megatron-serve", "app.kubernetes.io/instance": "rollout",
        "app.kubernetes.io/component": "engine"}}}, TRAINER]}]  # every port: the collectives pick theirs


def test_an_uncovered_or_open_unauthenticated_port_is_named():
    (resource,) = load_yaml(EXAMPLES / "single-gpu.yaml")
    objects = render(resource, CONFIG)
    without_engine_policy = [o for o in objects if o["metadata"]["name"] != "llama-1b-engine"]
    assert unauthenticated_ports(without_engine_policy) == [
        "StatefulSet/llama-1b-engine-0 container engine port rendezvous (29500): no NetworkPolicy selects this pod, "
        "so every pod in the cluster reaches it"]
    del resource["spec"]["server"]["apiKeySecretRef"]
    (problem,) = unauthenticated_ports(render(resource, CONFIG))
    assert problem.startswith("Deployment/llama-1b-coordinator container server port http (8000): open to every "
                              "pod and client") and "spec.server.apiKeySecretRef" in problem


def test_render_refuses_an_unauthenticated_port_unless_told_otherwise(tmp_path: pathlib.Path):
    (resource,) = load_yaml(EXAMPLES / "single-gpu.yaml")
    del resource["spec"]["server"]
    path = tmp_path / "open.yaml"
    path.write_text(yaml.safe_dump(resource))
    out, err = io.StringIO(), io.StringIO()
    assert rendering.render_command(str(path), out=out, err=err) == 1 and out.getvalue() == ""
    assert "MegatronInference/llama-1b: Deployment/llama-1b-coordinator container server port http (8000)" in \
        err.getvalue() and "--no-strict-security" in err.getvalue()
    out = io.StringIO()
    assert rendering.render_command(str(path), out=out, err=io.StringIO(), strict_security=False) == 0
    assert len(list(yaml.safe_load_all(out.getvalue()))) == 10  # with the two PodDisruptionBudgets
    command = [sys.executable, "-m", "megatron_serve.cli", "render", "-f", str(path)]
    strict = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert strict.returncode == 1 and "nothing asks for credentials" in strict.stderr
    loose = subprocess.run([*command, "--no-strict-security"], capture_output=True, text=True, timeout=60)
    assert loose.returncode == 0, loose.stderr
