"""Two operator processes on one namespace: kopf's peering keeps one of them acting, and the other takes over when the
first is killed; the control runs both ``--standalone`` and both act.

What is real: the API server, kopf's peering through a ``KopfPeering`` object (its CRD, ``kopfpeerings.kopf.dev``,
the chart's ``crds/`` copy, applied by the test: kopf does not install it; the chart's own peering mode, with
``replicaCount`` and ``peering.enabled``, is tested in test_real_chart_peering.py), both operators as processes holding the chart's ServiceAccount token (the chart's Role, plus the rule
kopf's peering needs on ``kopfpeerings``), the StatefulSet controller and the scheduler placing the engine pods on
kwok's nodes.

Which process acts is read from the resources: each renders another default image
(``MEGATRON_OPERATOR_DEFAULT_IMAGE``), so the engines' StatefulSets and the coordinator's Deployment carry the image
of the operator that wrote them last.

kopf's peering is not a leader election: operators of equal priority all pause ("Pausing all operators, including
self"), so the two run with distinct ``--priority`` values, and ``POD_ID`` names each in the peering object (what a
pod's name would give). A peer killed with SIGKILL never says goodbye: the other waits for its keep-alive to expire
(``MEGATRON_OPERATOR_PEERING_LIFETIME``, 10 s here; kopf's default 60 s) before it resumes.
"""

from __future__ import annotations

from typing import Any

import pytest

from .real_cluster import kube, kube_namespace  # noqa: F401 - the fixtures
from .real_fleet import Fleet, fleet  # noqa: F401 - the fixture
from .real_tools import CHART, MI, OperatorProcess, established, example, service_account_kubeconfig, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NAME = "llama-1b"
PEERING = "megatron-operator"
LIFETIME = 10

PEERING_CRD = CHART / "crds" / "kopf.dev_kopfpeerings.yaml"


def _image(operator: str) -> str:
    return f"example.com/megatron-serve:{operator}"





def _operator(fleet: Fleet, who: str, peering: tuple[str, ...]) -> OperatorProcess:
    kubeconfig = service_account_kubeconfig(fleet.kubectl, fleet.account, fleet.workdir / f"{who}.kubeconfig")
    process = OperatorProcess(kubeconfig, fleet.kubectl.namespace, fleet.workdir / f"{who}.log", scanning=False,
                              peering=peering,
                              env={"POD_ID": who, "MEGATRON_OPERATOR_DEFAULT_IMAGE": _image(who),
                                   "MEGATRON_OPERATOR_PEERING_LIFETIME": str(LIFETIME)}).start()
    fleet.operators.append(process)
    return process


def _resource(fleet: Fleet) -> dict[str, Any]:
    resource = example("single-gpu.yaml", fleet.kubectl.namespace)
    fleet.prerequisites(resource)
    return resource


def test_two_peered_operators_one_acts_and_the_other_takes_over_when_it_is_killed(fleet: Fleet):
    kubectl = fleet.kubectl
    kubectl.run("apply", "--server-side", "--force-conflicts", "-f", str(PEERING_CRD))
    established(kubectl, "kopfpeerings.kopf.dev")
    kubectl.apply([
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "kopf-peering"},
         "rules": [{"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"], "verbs": ["list", "watch", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "kopf-peering"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "kopf-peering"},
         "subjects": [{"kind": "ServiceAccount", "name": fleet.account, "namespace": kubectl.namespace}]},
    ])
    resource = _resource(fleet)
    first = _operator(fleet, "operator-a", (f"--peering={PEERING}", "--priority=200"))
    kubectl.apply([resource])
    until(lambda: fleet.placed(NAME, 1), 90, "the engine pod Running, made by the first operator")
    second = _operator(fleet, "operator-b", (f"--peering={PEERING}", "--priority=100"))
    paused = f"Pausing the watch-stream for megatroninferences.v1alpha1.serving.megatron.dev in '{kubectl.namespace}'"
    until(lambda: paused in second.log(), 60, "the second operator's word that it is paused")
    peers = until(lambda: (p := kubectl.get("kopfpeerings", PEERING)) and len(p.get("status") or {}) == 2 and p,
                  30, "both operators keeping themselves alive in the peering object")
    assert {k: v["priority"] for k, v in peers["status"].items()} == {"operator-a": 200, "operator-b": 100}
    # only the first acts: over several of its passes, the workloads carry its image and never the second's
    assert fleet.watch_images(NAME, 5) == {_image("operator-a")}
    assert f"[{kubectl.namespace}/{NAME}]" not in second.log()  # the second never handled the resource

    first.stop(kill=True)  # no goodbye: the second waits for the first's keep-alive to expire
    kubectl.run("scale", f"{MI}/{NAME}", "--replicas=2")
    until(lambda: "Resuming operations after the pause" in second.log(), LIFETIME + 30, "the second operator resuming")
    until(lambda: fleet.placed(NAME, 2) and fleet.images(NAME) == {_image("operator-b")}, 90,
          "two engine pods Running, every workload written by the second operator")
    assert ((fleet.mi(NAME).get("status") or {}).get("engines") or {}).get("desired") == 2


def test_control_two_standalone_operators_both_act(fleet: Fleet):
    """Without peering (the chart's ``--standalone``), two processes both reconcile the resource: each writes its
    own image over the other's, pass after pass."""
    resource = _resource(fleet)
    _operator(fleet, "operator-a", ("--standalone",))
    fleet.kubectl.apply([resource])
    until(lambda: fleet.placed(NAME, 1), 90, "the engine pod Running, made by the first operator")
    _operator(fleet, "operator-b", ("--standalone",))
    both = frozenset({_image("operator-a"), _image("operator-b")})
    assert fleet.watch_images(NAME, 20, enough=both) >= both
