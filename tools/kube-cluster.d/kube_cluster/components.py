"""What tools/kube-cluster builds, and how: one row per Go module, one cached folder per version.

Each component is a module of this repository (`tools/kube-cluster.d/<module>/go.mod` with its
`go.sum`) that requires the upstream release; `go build` of its commands lands in
`<cache>/<name>-<version>/bin`, and a `built` stamp there marks it complete, so a second `up`
(or a CI run that restored the cache) builds nothing. The Go module and build caches live
beside the binaries in the same root, so a cold CI build downloads each module once.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

KUBERNETES_VERSION = "v1.37.2"


def _kube_stamps(version: str) -> tuple[str, ...]:
    """`-X` flags that make every Kubernetes binary report `version` (what hack/lib/version.sh sets)."""
    major, minor = version.lstrip("v").split(".")[:2]
    flags: list[str] = []
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {package}.gitVersion={version}",
            f"-X {package}.gitMajor={major}",
            f"-X {package}.gitMinor={minor}",
            f"-X {package}.gitTreeState=clean",
            f"-X {package}.buildDate=1970-01-01T00:00:00Z",
        ]
    return tuple(flags)


@dataclass(frozen=True)
class Component:
    """One upstream release built from its Go module into `<cache>/<name>-<version>/bin`."""

    name: str
    version: str
    module: str  # folder under tools/kube-cluster.d holding go.mod/go.sum
    packages: tuple[str, ...]  # import paths of the commands (or "." for this module's main)
    stamps: tuple[str, ...] = ()
    # Files copied out of the upstream module (path inside it -> name in the cache folder), for
    # what the binary needs beside it at run time (kwok's stages, LWS's CRDs and webhooks).
    extras: dict[str, str] = field(default_factory=dict)
    upstream: str = ""  # the module the extras come from, as `path@version`

    def folder(self, cache: Path) -> Path:
        return cache / f"{self.name}-{self.version}"

    def binary(self, cache: Path, command: str) -> Path:
        return self.folder(cache) / "bin" / command

    def built(self, cache: Path) -> bool:
        return (self.folder(cache) / "built").is_file()


COMPONENTS: tuple[Component, ...] = (
    Component(
        name="kubernetes",
        version=KUBERNETES_VERSION,
        module="k8s",
        packages=tuple(
            f"k8s.io/kubernetes/cmd/{c}"
            for c in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
        ),
        stamps=_kube_stamps(KUBERNETES_VERSION),
    ),
    Component(name="etcd", version="v3.6.16", module="etcd", packages=(".",)),
    Component(
        name="kwok",
        version="v0.8.0",
        module="kwok",
        packages=("sigs.k8s.io/kwok/cmd/kwok",),
        stamps=("-X sigs.k8s.io/kwok/pkg/consts.Version=0.8.0",),
        # The release's default stages (what kwokctl feeds it): nodes become Ready and keep a
        # lease, pods become Running/Ready, and deleted pods go away.
        extras={
            "kustomize/stage/node/fast/node-initialize.yaml": "stages/node-initialize.yaml",
            "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml":
                "stages/node-heartbeat-with-lease.yaml",
            "kustomize/stage/pod/fast/pod-ready.yaml": "stages/pod-ready.yaml",
            "kustomize/stage/pod/fast/pod-complete.yaml": "stages/pod-complete.yaml",
            "kustomize/stage/pod/fast/pod-delete.yaml": "stages/pod-delete.yaml",
        },
        upstream="sigs.k8s.io/kwok@v0.8.0",
    ),
    Component(
        name="helm",
        version="v3.22.0",
        module="helm",
        packages=("helm.sh/helm/v3/cmd/helm",),
        # helm's own Makefile stamps its version and the client-go minor it was built against
        # (`.Capabilities.KubeVersion` of `helm template` without a cluster).
        stamps=(
            "-X helm.sh/helm/v3/internal/version.version=v3.22.0",
            "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
            "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1",
            "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=37",
        ),
    ),
    Component(
        name="lws",
        version="v0.9.0",
        module="lws",
        packages=("sigs.k8s.io/lws/cmd",),
        stamps=("-X sigs.k8s.io/lws/pkg/version.GitVersion=v0.9.0",),
        extras={
            "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml":
                "crds/leaderworkerset.x-k8s.io_leaderworkersets.yaml",
            "config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml":
                "crds/disaggregatedset.x-k8s.io_disaggregatedsets.yaml",
            "config/webhook/manifests.yaml": "webhooks.yaml",
        },
        upstream="sigs.k8s.io/lws@v0.9.0",
    ),
)

BY_NAME = {c.name: c for c in COMPONENTS}


def cache_root() -> Path:
    """The cache shared by a machine's sessions and its CI runs (MEGATRON_KUBE_CACHE overrides)."""
    configured = os.environ.get("MEGATRON_KUBE_CACHE")
    if configured:
        return Path(configured).expanduser().resolve()
    return Path.home() / ".cache" / "megatron-serve" / "kube"


def go_environment(cache: Path) -> dict[str, str]:
    """The environment of every `go` call: caches under the kube cache, static binaries."""
    env = dict(os.environ)
    env.update(
        GOMODCACHE=str(cache / "go" / "mod"),
        GOCACHE=str(cache / "go" / "build"),
        GOPATH=str(cache / "go" / "path"),
        CGO_ENABLED="0",
        GOFLAGS="-mod=readonly -buildvcs=false",
    )
    env.setdefault("GOTOOLCHAIN", "local")
    return env


def _go() -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if go is None:
        raise SystemExit("kube-cluster: `go` is not on PATH; the control plane is built from Go modules")
    return go


def build(component: Component, cache: Path) -> float:
    """Build one component into its cache folder; return the seconds it took (0 when cached).

    A lock per component lets clusters start side by side on a cold cache: the second waits for
    the first one's build instead of racing it."""
    if component.built(cache):
        return 0.0
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f"{component.name}-{component.version}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if component.built(cache):
            return 0.0
        return _build(component, cache)


def _build(component: Component, cache: Path) -> float:
    folder = component.folder(cache)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "bin").mkdir(parents=True)
    env = go_environment(cache)
    go = _go()
    source = HERE / component.module
    ldflags = " ".join(("-s", "-w") + component.stamps)
    started = time.monotonic()
    print(f"kube-cluster: building {component.name} {component.version} (cold builds take minutes)",
          file=sys.stderr, flush=True)
    log = staging / "build.log"
    with log.open("w") as out:
        command = [go, "build", "-trimpath", "-ldflags", ldflags, "-o", str(staging / "bin") + "/",
                   *component.packages]
        done = subprocess.run(command, cwd=source, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"kube-cluster: building {component.name} {component.version} failed; "
                         f"see {log}:\n{log.read_text()[-3000:]}")
    if component.name == "lws":
        (staging / "bin" / "cmd").rename(staging / "bin" / "lws-controller")
    if component.extras:
        _copy_extras(component, staging, env, go, source)
    seconds = time.monotonic() - started
    (staging / "build-seconds").write_text(f"{seconds:.0f}\n")
    (staging / "built").write_text(f"{component.name} {component.version}\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    print(f"kube-cluster: built {component.name} {component.version} in {seconds:.0f} s (cold)",
          file=sys.stderr, flush=True)
    return seconds


def _copy_extras(component: Component, staging: Path, env: dict[str, str], go: str, source: Path) -> None:
    """Copy run-time files out of the upstream module (already in GOMODCACHE after the build)."""
    listed = subprocess.run([go, "list", "-m", "-f", "{{.Dir}}", component.upstream.split("@")[0]],
                            cwd=source, env=env, capture_output=True, text=True, check=True)
    upstream = Path(listed.stdout.strip())
    for inside, target in component.extras.items():
        destination = staging / target
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(upstream / inside, destination)


def build_all(cache: Path, names: tuple[str, ...] | None = None) -> dict[str, float]:
    """Build what is missing; the answer maps each component to its cold build seconds (0: cached)."""
    chosen = COMPONENTS if names is None else tuple(BY_NAME[n] for n in names)
    return {c.name: build(c, cache) for c in chosen}
