"""The CRD, every manifest and every resource in the documentation, on a real kube-apiserver.

The API server applies the CRD's structural schema, its defaults, pruning and CEL rules itself; ``kubectl apply
--dry-run=server`` runs all of it without storing anything. The python twins in :mod:`megatron_operator.spec` and
cel-python (``test_operator_crd.py``) only stand in for it: here every resource ``test_operator_crd.BAD`` says is
bad is refused by the server too, naming the field, and a copy of the CRD under another group without the CEL
rules (the control) takes the resources only the rules refuse.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import yaml

from megatron_operator import crd

from .real_cluster import Namespace, kube, kube_namespace  # noqa: F401 - the fixtures
from .real_tools import Kubectl, MI, ROOT, clients, established, until
from .test_operator_crd import BAD, _bad

DOCS = sorted([*ROOT.glob("docs/**/*.md"), *ROOT.glob("*.md"), *ROOT.glob("charts/**/*.md"),
               *ROOT.glob("manifests/**/*.md")])
YAML_BLOCK = re.compile(r"```ya?ml\n(.*?)```", re.S)


@pytest.fixture
def kubectl(kube_namespace: Namespace) -> Kubectl:
    return clients(kube_namespace)[0]


def refusals(kubectl: Kubectl, resources: list[dict[str, Any]], *flags: str) -> dict[str, str]:
    """``kubectl apply --dry-run=server`` of every resource at once: name -> the server's error line (the names
    it accepted are absent)."""
    done = kubectl.apply(resources, "--dry-run=server", *flags, check=False)
    found: dict[str, str] = {}
    for line in done.stderr.splitlines():
        for resource in resources:
            name = resource["metadata"]["name"]
            if f'"{name}"' in line or f"/{name}" in line or f"name: {name!r}" in line:
                found.setdefault(name, line)
    accepted = {line.split()[0] for line in done.stdout.splitlines() if "(server dry run)" in line}
    for resource in resources:  # an error kubectl printed without the name (a strict decoding error) still refuses
        name = resource["metadata"]["name"]
        if name not in found and not any(item.endswith(f"/{name}") for item in accepted):
            found[name] = done.stderr.strip()
    return found


def test_crd_is_established_with_its_subresources_and_columns(kubectl: Kubectl):
    live = kubectl.get("crd", crd.CRD_NAME)
    version = live["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.parallelism.data"
    assert [c["name"] for c in version["additionalPrinterColumns"]] == \
        [c["name"] for c in crd.crd()["spec"]["versions"][0]["additionalPrinterColumns"]]
    # the schema the server stores is ours, CEL rules included (nothing pruned or rewritten on the way in)
    assert version["schema"]["openAPIV3Schema"] == crd.openapi_schema()
    explained = kubectl.run("explain", f"{crd.PLURAL}.spec.engine.speculative", f"--api-version={crd.API_VERSION}").stdout
    assert "promptLookupMin" in explained


def manifests() -> list[tuple[str, list[dict[str, Any]]]]:
    """Every file of objects under ``manifests/examples`` (the kustomize base has a test of its own), each object
    out of the namespace it names (the test applies them into its own)."""
    out = []
    for path in sorted((ROOT / "manifests" / "examples").rglob("*.yaml")):
        if path.name == "prometheus-adapter-values.yaml":  # helm values of another chart, not an object
            continue
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        for doc in docs:
            doc["metadata"].pop("namespace", None)
        out.append((str(path.relative_to(ROOT)), docs))
    return out


def test_every_manifest_passes_server_dry_run(kubectl: Kubectl):
    failures = {}
    for label, docs in manifests():
        done = kubectl.apply(docs, "--dry-run=server", "--validate=strict", check=False)
        if done.returncode != 0 or "Warning" in done.stderr:
            failures[label] = done.stderr.strip()
    assert failures == {}


def test_the_kustomize_base_passes_server_dry_run(kubectl: Kubectl):
    """``kubectl apply -k manifests/`` as kubectl builds it, into this test's namespace: the base's Namespace and
    the CRD are applied once per cluster, so they are dry-run on their own."""
    built = [d for d in yaml.safe_load_all(kubectl.run("kustomize", str(ROOT / "manifests")).stdout) if d]
    kinds = sorted(d["kind"] for d in built)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment", "Namespace",
                     "ServiceAccount"]
    moved = []
    for doc in built:
        if doc["kind"] in ("Namespace", "CustomResourceDefinition"):
            done = kubectl.apply([doc], "--dry-run=server", "--validate=strict", "--server-side", check=False)
            assert done.returncode == 0, done.stderr
            continue
        doc = copy.deepcopy(doc)
        if "namespace" in doc["metadata"]:
            doc["metadata"]["namespace"] = kubectl.namespace
        for subject in doc.get("subjects", []):
            subject["namespace"] = kubectl.namespace
        moved.append(doc)
    done = kubectl.apply(moved, "--dry-run=server", "--validate=strict", check=False)
    assert done.returncode == 0, done.stderr


def _merge(base: Any, part: Any) -> Any:
    if isinstance(base, dict) and isinstance(part, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in part.items()}}
    return copy.deepcopy(part)


def doc_resources() -> list[tuple[str, dict[str, Any]]]:
    """Every Kubernetes object in a YAML block of the docs, and every ``spec:`` excerpt of a MegatronInference
    laid over the single-GPU example (as a reader would paste it into one)."""
    (base,) = [d for d in yaml.safe_load_all((ROOT / "manifests" / "examples" / "single-gpu.yaml").read_text())
               if d]
    out = []
    for path in DOCS:
        for i, match in enumerate(YAML_BLOCK.finditer(path.read_text())):
            for doc in yaml.safe_load_all(match.group(1)):
                label = f"{path.relative_to(ROOT)} block {i + 1}"
                if isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc:
                    out.append((label, doc))
                elif isinstance(doc, dict) and set(doc) == {"spec"}:
                    merged = _merge(base, doc)
                    merged["metadata"] = {"name": f"doc-{len(out)}"}
                    out.append((label, merged))
    return out


def test_every_resource_in_the_docs_passes_server_dry_run(kubectl: Kubectl):
    found = doc_resources()
    assert len(found) >= 8, [label for label, _ in found]  # install.md x2, kv-routing, kv-tiers x2, lora, ...
    failures = {}
    for label, doc in found:
        done = kubectl.apply([doc], "--dry-run=server", "--validate=strict", check=False)
        if done.returncode != 0:
            failures[label] = done.stderr.strip()
    assert failures == {}


def bad_resources() -> dict[str, dict[str, Any]]:
    """``test_operator_crd.BAD``'s resources, each under a name of its own (the two cases about the name keep
    theirs)."""
    out = {}
    for i, case in enumerate(sorted(BAD)):
        resource = _bad(BAD[case][0])
        if not case.startswith("name "):
            resource["metadata"]["name"] = f"bad-{i}"
        out[case] = resource
    return out


RULE_MESSAGES = {message for _, _, message, _ in crd.CEL_RULES}


def _field(reason: str) -> str:
    """The field a python reason names: ``spec.engine.parallelism`` of ``spec.engine.parallelism: ...``."""
    return reason.split(":", 1)[0]


def test_the_api_server_refuses_every_bad_resource_naming_the_field(kubectl: Kubectl):
    """One dry-run of all of ``BAD`` with strict field validation: each is refused, and the error names the field
    (a CEL rule's own message included) as the operator's twin does. The example itself is accepted (the
    control: a refusal is the mutation's)."""
    (good,) = [d for d in yaml.safe_load_all((ROOT / "manifests" / "examples" / "tp2-dp4.yaml").read_text()) if d]
    assert refusals(kubectl, [good], "--validate=strict") == {}
    bad = bad_resources()
    refused = refusals(kubectl, list(bad.values()), "--validate=strict")
    missing = sorted(case for case, r in bad.items() if r["metadata"]["name"] not in refused)
    assert missing == [], f"the API server accepts {missing}"
    unnamed = {}
    for case, resource in bad.items():
        line = refused[resource["metadata"]["name"]]
        reason = BAD[case][1]
        field = _field(reason)
        message = reason.split(": ", 1)[1]
        if any(rule.startswith(message) for rule in RULE_MESSAGES):  # a CEL rule's: the server says its message on the object the rule is on
            if message[:60] not in line or (field != "(root)" and f"{field}: Invalid value" not in line):
                unnamed[case] = line
        elif field not in line:
            unnamed[case] = line
    assert unnamed == {}


@pytest.mark.parametrize(("case", "shown"), [
    ("unknown lifecycle", 'spec.lifecycle: Unsupported value: "Sleeping"'),
    ("zero tensor", "spec.parallelism.tensor: Invalid value: 0"),
    ("expert neither 1 nor tensor", "spec.engine.parallelism: Invalid value: engine.parallelism.expert must be 1"),
    ("unknown field", 'unknown field "spec.replicas"'),
])
def test_the_issues_four_refusals_read_as_kubectl_prints_them(kubectl: Kubectl, case: str, shown: str):
    resource = bad_resources()[case]
    done = kubectl.apply([resource], "--dry-run=server", "--validate=strict", check=False)
    assert done.returncode != 0 and shown in done.stderr, done.stderr


def test_unknown_fields_are_pruned_without_strict_validation(kubectl: Kubectl):
    """The control of the strict case: without ``--validate=strict`` the server takes the resource and drops the
    unknown field (what a user would lose silently), which is why the docs tell ``--validate=strict``."""
    resource = bad_resources()["unknown field"]
    resource["metadata"]["name"] = "pruned"
    done = kubectl.apply([resource], "--validate=false")
    assert "created" in done.stdout, done.stdout
    live = kubectl.get(MI, "pruned")
    assert "replicas" not in live["spec"] and live["spec"]["lifecycle"] == "Running"  # and defaulted
    kubectl.run("delete", MI, "pruned", "--wait=false")


CONTROL_GROUP = "control.megatron.dev"
CONTROL_KIND = "RulelessInference"
CONTROL_PLURAL = "rulelessinferences"


def test_cel_rules_are_what_refuses_cross_field_layouts(kubectl: Kubectl):
    """The control: the same CRD under another group without its CEL rules takes every case that only a rule
    refuses, so the refusals above come from the rules the CRD states."""
    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "x-kubernetes-validations"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    control = strip(crd.crd())
    control["metadata"]["name"] = f"{CONTROL_PLURAL}.{CONTROL_GROUP}"
    control["spec"]["group"] = CONTROL_GROUP
    # names of its own: a kind of the same plural or short name would shadow ours for every kubectl of the run
    control["spec"]["names"] = {"kind": CONTROL_KIND, "listKind": f"{CONTROL_KIND}List", "plural": CONTROL_PLURAL,
                                "singular": CONTROL_KIND.lower()}
    kubectl.apply([control], "--server-side", "--force-conflicts")
    try:
        _refused_only_with_the_rules(kubectl, control["metadata"]["name"])
    finally:
        kubectl.run("delete", "crd", control["metadata"]["name"], "--wait=false")


def _refused_only_with_the_rules(kubectl: Kubectl, control: str) -> None:
    established(kubectl, control)
    ruled = {case: r for case, r in bad_resources().items()
             if _field(BAD[case][1]) in ("spec", "spec.model", "spec.lora", "spec.engine", "spec.engine.parallelism",
                                         "spec.engine.speculative", "(root)")
             and not any(word in BAD[case][1] for word in ("required field", "must match", "at most 256"))}
    assert len(ruled) >= 15, sorted(ruled)
    moved = [dict(copy.deepcopy(r), apiVersion=f"{CONTROL_GROUP}/{crd.VERSION}", kind=CONTROL_KIND)
             for r in ruled.values()]
    until(lambda: kubectl.run("get", f"{CONTROL_PLURAL}.{CONTROL_GROUP}", check=False).returncode == 0, 30,
          "the control kind served")
    assert refusals(kubectl, moved, "--validate=strict") == {}
    assert set(refusals(kubectl, list(ruled.values()), "--validate=strict")) == \
        {r["metadata"]["name"] for r in ruled.values()}
