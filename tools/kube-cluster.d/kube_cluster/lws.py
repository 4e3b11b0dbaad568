"""The LeaderWorkerSet controller as a local process, with its CRDs and admission webhooks.

In a cluster LWS runs as a Deployment whose webhooks the API server reaches through a Service,
with certificates it rotates itself. Here the controller runs beside the API server, so its
webhook configurations (the release's `config/webhook/manifests.yaml` with its kustomize
patches applied: the pod webhooks only see LWS pods) name a URL on 127.0.0.1 instead, served
with a certificate from the cluster's CA. The webhooks matter: they default LWS objects and
give each pod its group/worker labels and the leader address, which the controller relies on.
"""

from __future__ import annotations

import base64
import json
import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path

from . import components, processes
from .api import Api

POD_SELECTOR = {"matchExpressions": [{"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}


def _config(folder: Path, ports: dict[str, int]) -> Path:
    certs = folder / "pki" / "lws-webhook-serving"
    certs.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(folder / "pki" / "lws-webhook.crt", certs / "tls.crt")
    shutil.copyfile(folder / "pki" / "lws-webhook.key", certs / "tls.key")
    config = {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": ports["lws-webhook"], "certDir": str(certs)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['lws-health']}"},
    }
    path = folder / "lws-config.json"
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


def _webhooks(folder: Path, ports: dict[str, int], release: Path, kubectl: Callable[..., str]) -> str:
    """The release's webhook configurations, pointed at the local controller (a List as JSON)."""
    printed = kubectl("create", "--dry-run=client", "-o", "json", "-f", str(release))
    items, decoder, at = [], json.JSONDecoder(), 0
    while printed[at:].strip():  # kubectl prints one JSON object per document, back to back
        item, end = decoder.raw_decode(printed[at:].lstrip())
        at = len(printed) - len(printed[at:].lstrip()) + end
        items.append(item)
    ca = base64.b64encode((folder / "pki" / "ca.crt").read_bytes()).decode()
    for item in items:
        item["metadata"] = {"name": "lws-" + item["metadata"]["name"]}
        for hook in item["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{ports['lws-webhook']}{path}", "caBundle": ca}
            if any("pods" in rule.get("resources", []) for rule in hook.get("rules", [])):
                hook["objectSelector"] = POD_SELECTOR
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})


def _healthy(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
        return answer.status == 200


def start(cache: Path, folder: Path, ports: dict[str, int], kubeconfig: Path, api: Api,
          kubectl: Callable[..., str]) -> None:
    """Install the CRDs, start the controller, register its webhooks, wait until it serves."""
    release = components.BY_NAME["lws"]
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(release.folder(cache) / "crds"))
    crd = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/leaderworkersets.leaderworkerset.x-k8s.io"
    processes.wait("the LeaderWorkerSet CRD to be Established",
                   lambda: any(c["type"] == "Established" and c["status"] == "True"
                               for c in api.get(crd).get("status", {}).get("conditions", [])), 60)
    processes.start(folder, "lws-controller",
                    [str(release.binary(cache, "lws-controller")), f"--config={_config(folder, ports)}"],
                    env={"KUBECONFIG": str(kubeconfig)})
    processes.wait("the LWS controller's /readyz", lambda: _healthy(ports["lws-health"]), 120,
                   folder / "lws-controller.log")
    processes.wait("the LWS webhook port", lambda: not processes.port_free(ports["lws-webhook"]), 60,
                   folder / "lws-controller.log")
    kubectl("apply", "-f", "-", stdin=_webhooks(folder, ports, release.folder(cache) / "webhooks.yaml", kubectl))
    api.get("/apis/leaderworkerset.x-k8s.io/v1")
