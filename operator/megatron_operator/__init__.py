"""megatron-serve Kubernetes operator: CRD model, rendering of child objects, lifecycle control.

Submodules, one job each:

- :mod:`.crd`: the CustomResourceDefinition as data (single source of the YAML files);
- :mod:`.spec`: validation and defaults of a resource (pure Python);
- :mod:`.render`: resource -> child objects (pure function), and ``megatron-serve render``;
- :mod:`.lifecycle`: spec.lifecycle <-> coordinator states, and the verbs between them;
- :mod:`.coordinator_link`: the operator's only contact with the coordinator client;
- :mod:`.kube`: the operator's only contact with the Kubernetes API (besides kopf itself);
- :mod:`.reconcile` / :mod:`.status`: child reconciliation and status computation;
- :mod:`.handlers`: the kopf handlers; :mod:`.cli`: entry points for ``megatron-serve``;
- :mod:`.probe`: engine pod readiness/liveness probes (``python -m megatron_operator.probe``).
"""

from megatron_serve import __version__

__all__ = ["__version__"]
