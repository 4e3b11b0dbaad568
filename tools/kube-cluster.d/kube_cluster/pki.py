"""The cluster's certificates and kubeconfigs, made with Debian's `openssl` into DIR/pki.

One CA signs everything (serving certificates of etcd, the API server and the LWS webhook;
client certificates of each component), as kubeadm's single-CA layout does; the
ServiceAccount token keys are an RSA pair. Existing files are kept, so a second `up` on the
same DIR (etcd's data kept) keeps every identity the cluster already trusts.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The in-cluster names of the API server (what a pod's client dials) and the first IP of
# the service range, which the `kubernetes` Service takes.
SERVICE_CIDR = "10.96.0.0/16"
API_SERVICE_IP = "10.96.0.1"
API_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local")


@dataclass(frozen=True)
class Identity:
    """A client certificate: its CN is the user, its O entries are the groups."""

    file: str
    user: str
    groups: tuple[str, ...] = ()


# Who each component is to RBAC: the admin (system:masters, as kubeadm's admin.conf), the
# controller-manager and scheduler as their built-in users (their ClusterRoleBindings ship with
# the API server), kwok (it writes every fake node's and pod's status, the kubelets' job) and the
# LWS controller as cluster admins.
IDENTITIES = (
    Identity("admin", "kubernetes-admin", ("system:masters",)),
    Identity("controller-manager", "system:kube-controller-manager"),
    Identity("scheduler", "system:kube-scheduler"),
    Identity("kwok", "kwok-controller", ("system:masters",)),
    Identity("lws", "lws-controller-manager", ("system:masters",)),
    Identity("apiserver-etcd-client", "kube-apiserver-etcd-client"),
    # The API server's identity toward aggregated API servers (the front proxy), as kubeadm's.
    Identity("front-proxy-client", "front-proxy-client"),
)


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"kube-cluster: openssl {' '.join(args[:2])} failed: {done.stderr.strip()}")


def _leaf(pki: Path, name: str, subject: str, extensions: str) -> None:
    """A key and a certificate signed by the CA, unless both already exist."""
    if (pki / f"{name}.crt").exists() and (pki / f"{name}.key").exists():
        return
    (pki / f"{name}.ext").write_text(extensions)
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=pki)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "3650", "-sha256", "-extfile", f"{name}.ext",
             "-out", f"{name}.crt", cwd=pki)
    (pki / f"{name}.csr").unlink()
    (pki / f"{name}.ext").unlink()


def _serving(pki: Path, name: str, names: tuple[str, ...], ips: tuple[str, ...]) -> None:
    alt = ",".join([f"DNS:{n}" for n in names] + [f"IP:{ip}" for ip in ips])
    _leaf(pki, name, f"/CN={name}",
          "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
          f"extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName={alt}\n")


def _client(pki: Path, identity: Identity) -> None:
    subject = "".join(f"/O={g}" for g in identity.groups) + f"/CN={identity.user}"
    _leaf(pki, identity.file, subject,
          "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
          "extendedKeyUsage=clientAuth\n")


def make(pki: Path) -> None:
    """Create (or keep) the CA, every serving and client certificate, and the token key pair."""
    if shutil.which("openssl") is None:
        raise SystemExit("kube-cluster: `openssl` is not on PATH (Debian: apt-get install openssl)")
    pki.mkdir(parents=True, exist_ok=True)
    if not (pki / "ca.crt").exists():
        _openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650", "-sha256",
                 "-subj", "/CN=megatron-serve-kube-ca",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature", cwd=pki)
    _serving(pki, "etcd-server", ("localhost",), ("127.0.0.1",))
    _serving(pki, "apiserver", API_NAMES, ("127.0.0.1", API_SERVICE_IP))
    _serving(pki, "lws-webhook", ("localhost",), ("127.0.0.1",))
    for identity in IDENTITIES:
        _client(pki, identity)
    if not (pki / "sa.key").exists():
        _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=pki)
        _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    for key in pki.glob("*.key"):
        key.chmod(0o600)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig(pki: Path, server: str, identity: str) -> str:
    """A kubeconfig (JSON, which kubectl and client-go read as YAML) with certificates inline,
    so the file stays valid when copied elsewhere."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "megatron-kube", "cluster": {
            "server": server, "certificate-authority-data": _b64(pki / "ca.crt")}}],
        "users": [{"name": identity, "user": {
            "client-certificate-data": _b64(pki / f"{identity}.crt"),
            "client-key-data": _b64(pki / f"{identity}.key")}}],
        "contexts": [{"name": "megatron-kube", "context": {"cluster": "megatron-kube", "user": identity}}],
        "current-context": "megatron-kube",
    }
    return json.dumps(config, indent=2) + "\n"
