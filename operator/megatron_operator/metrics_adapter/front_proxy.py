"""Who may ask the adapter: the API server's front proxy, as every aggregated API server decides it.

The aggregation layer authenticates and authorizes the caller (the HPA controller's RBAC to read
``custom.metrics.k8s.io``) before it proxies, then connects with its own client certificate
(``--proxy-client-cert-file``). The cluster publishes the CA of that certificate and the names it may carry in the
ConfigMap ``kube-system/extension-apiserver-authentication`` (readable through the Role
``extension-apiserver-authentication-reader``): a request is admitted when its TLS peer presented a certificate that
CA signed, with an allowed common name. Anything else that reaches the port (it serves on the pod network) is
refused with 401. The ConfigMap is read once, at start: restart the adapter after rotating the front proxy's CA.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import Any

import kubernetes

CONFIGMAP_NAMESPACE = "kube-system"
CONFIGMAP = "extension-apiserver-authentication"


@dataclass(frozen=True)
class FrontProxy:
    """The front proxy's CA (PEM) and the common names its certificate may have (empty: any it signed)."""

    client_ca: str
    allowed_names: tuple[str, ...]

    @classmethod
    def from_configmap(cls, data: dict[str, str]) -> "FrontProxy":
        """From the ConfigMap's data; a cluster without an aggregation layer configured has no CA there."""
        ca = data.get("requestheader-client-ca-file")
        if not ca:
            raise RuntimeError(f"{CONFIGMAP_NAMESPACE}/{CONFIGMAP} has no requestheader-client-ca-file: the API server "
                               "runs without --requestheader-client-ca-file, so no aggregated API can be reached")
        return cls(ca, tuple(json.loads(data.get("requestheader-allowed-names") or "[]")))

    @classmethod
    def from_cluster(cls, api: kubernetes.client.CoreV1Api) -> "FrontProxy":
        configmap = api.read_namespaced_config_map(CONFIGMAP, CONFIGMAP_NAMESPACE)
        return cls.from_configmap(configmap.data or {})

    def refusal(self, peercert: dict[str, Any] | None) -> str | None:
        """Why a peer may not ask (``None``: it may). ``peercert`` is ``SSLSocket.getpeercert()``'s: empty or
        ``None`` when the peer presented no certificate the CA verified (the handshake verified the chain)."""
        if not peercert:
            return "no client certificate signed by the front proxy's CA (only the API server's aggregation layer " \
                   "may ask this server)"
        names = [value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName"]
        if self.allowed_names and not set(names) & set(self.allowed_names):
            return f"client certificate {names} is not one of the front proxy's names {list(self.allowed_names)}"
        return None


def server_context(cert_file: str, key_file: str, proxy: FrontProxy) -> ssl.SSLContext:
    """TLS with the adapter's serving certificate, asking for (not requiring: health probes present none) a client
    certificate signed by the front proxy's CA."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    context.load_verify_locations(cadata=proxy.client_ca)
    context.verify_mode = ssl.CERT_OPTIONAL
    context.set_alpn_protocols(["http/1.1"])
    return context
