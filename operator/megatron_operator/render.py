"""Rendering: a ``MegatronInference`` resource -> the child objects the operator creates.

:func:`render` is a pure function: the same resource and configuration always give the same
objects in the same order (docs/reference/megatroninference.md):

1. Secret ``<name>-coordinator-token`` (the fleet secret: every child reads it),
2. Service ``<name>`` (OpenAI port; the endpoint ``http://<name>.<namespace>.svc:<port>/v1``),
3. Service ``<name>-coordinator`` (ZeroMQ port 5555),
4. NetworkPolicy ``<name>-coordinator`` (port 5555 only from engine, server, operator and trainer pods),
5. NetworkPolicy ``<name>-engine`` (engine pods: every port only from engine and trainer pods),
6. Deployment ``<name>-coordinator`` (1 replica: coordinator + OpenAI server containers),
7. for each data-parallel group g: headless Service ``<name>-engine-<g>`` (rank rendezvous,
   ``publishNotReadyAddresses``) then StatefulSet ``<name>-engine-<g>`` (pods of the group); a gang
   (``spec.engine.parallelism``) on a cluster with the LeaderWorkerSet CRD: LeaderWorkerSet
   ``<name>-engine-<g>`` alone (:mod:`.leader_worker_set`),
8. PodDisruptionBudgets ``<name>-engine`` and ``<name>-coordinator`` (``spec.disruptionBudget``; :mod:`.disruption`).

Every object carries ``app.kubernetes.io/instance=<name>`` and, when the resource has a uid,
an ownerReference to it. The token is an HMAC of the resource's identity under the operator's
key, so re-rendering with that key gives the same Secret; the operator additionally never
rotates the token of an existing Secret (it passes it in as ``token``). There is no default key:
``megatron-serve render`` without the operator's key renders random tokens.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import hmac
import os
import sys
from typing import Any

from megatron_serve.fleet.argv import kv_role_argv
from megatron_serve.wire.security import read_secret_file

from .config import ENV_TOKEN_KEY, ENV_TOKEN_KEY_FILE, OperatorConfig, token_key_from_env
from .crd_kv_tiers import with_host_tier
from .crd_tenants import server_tenancy
from .disruption import render_budgets
from .engine_args import engine_flags, layout_flags, lora_flags
from .kv_node import disk_volume, events_container_ports, render_events_service
from .leader_worker_set import render_engine_lws
from .model_fetch import fetch_container
from .names import (COORDINATOR_PORT, RENDEZVOUS_PORT, coordinator_name, coordinator_service_address, engine_name,
                    labels, object_meta, secret_name, selector_labels, server_service_name, service)
from .network import API_KEY_ENV, coordinator_policy, engine_policy, unauthenticated_ports
from .spec import InferenceSpec, SpecError, parse

TOKEN_KEY = "token"
ENGINE_SHM_LIMIT = "8Gi"
DEFAULT_SIDE_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}}
UID = 1000


def derive_token(key: bytes, namespace: str, name: str, uid: str | None) -> str:
    msg = f"{namespace}/{name}/{uid or ''}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


# ----------------------------------------------------------------------------- pieces

def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": UID,
        "runAsGroup": UID,
        "fsGroup": UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _base_env(spec: InferenceSpec) -> list[dict[str, Any]]:
    return [
        {"name": "MEGATRON_SERVE_TOKEN",
         "valueFrom": {"secretKeyRef": {"name": secret_name(spec.name), "key": TOKEN_KEY}}},
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "HF_HOME", "value": "/tmp/.cache/huggingface"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/.cache/triton"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def _volumes(spec: InferenceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    if spec.model_volume or spec.model_hub:
        # A Hub model without a volume of its own is fetched into each pod's emptyDir.
        volumes.append({"name": "model", **(spec.model_volume or {"emptyDir": {}})})
        mounts.append({"name": "model", "mountPath": spec.model_mount_path, "readOnly": True})
    return volumes, mounts


def _init(spec: InferenceSpec, config: OperatorConfig, weights: bool = True) -> dict[str, Any]:
    """The pod's ``initContainers``: ``fetch-model`` when ``spec.model.hub`` is set (:mod:`.model_fetch`), else
    none (the field is absent, so templates without a hub stay unchanged)."""
    if not spec.model_hub:
        return {}
    return {"initContainers": [fetch_container(spec, spec.model_hub, image=_image_fields(spec, config),
                                               weights=weights, resources=DEFAULT_SIDE_RESOURCES,
                                               security_context=_container_security())]}


def _image_fields(spec: InferenceSpec, config: OperatorConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"image": spec.image or config.default_image}
    if spec.image_pull_policy:
        out["imagePullPolicy"] = spec.image_pull_policy
    return out


def _pod_common(spec: InferenceSpec) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.drain_timeout_seconds + 30,
        "securityContext": _pod_security(),
    }
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [dict(s) for s in spec.image_pull_secrets]
    return pod


def _model_flags(spec: InferenceSpec) -> list[str]:
    flags = ["--model", spec.model_path]
    return flags


def _scale_from_zero_flags(spec: InferenceSpec) -> list[str]:
    """The server's holding flags while spec.server.scaleFromZero is on; none while off (the server's own default,
    so that the pod templates of fleets that never scale to zero stay unchanged)."""
    holding = spec.scale_from_zero
    if not holding["timeoutSeconds"]:
        return []
    return ["--scale-from-zero-timeout", str(holding["timeoutSeconds"]), "--scale-from-zero-queue",
            str(holding["queue"])]


def _served_name(spec: InferenceSpec) -> list[str]:
    """A Hub model is served under its id (``Qwen/Qwen3-0.6B``), as vLLM does, not its directory's name."""
    return ["--served-model-name", spec.model_hub.split("@", 1)[0]] if spec.model_hub else []


def _lora_volume(spec: InferenceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The adapter volume of the engine pods, mounted read-only (none without ``spec.lora.volume``)."""
    if spec.lora is None or "volume" not in spec.lora:
        return [], []
    return ([{"name": "lora", **spec.lora["volume"]}],
            [{"name": "lora", "mountPath": spec.lora["mountPath"], "readOnly": True}])


# ----------------------------------------------------------------------------- objects

def render_secret(spec: InferenceSpec, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(spec, secret_name(spec.name), "coordinator"),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def render_server_service(spec: InferenceSpec) -> dict[str, Any]:
    return service(spec, server_service_name(spec.name), "coordinator",
                   [{"name": "http", "port": spec.server_port, "targetPort": "http"}])


def render_coordinator_service(spec: InferenceSpec) -> dict[str, Any]:
    return service(spec, coordinator_name(spec.name), "coordinator",
                   [{"name": "coordinator", "port": COORDINATOR_PORT, "targetPort": "coordinator"}])


def render_coordinator_deployment(spec: InferenceSpec, config: OperatorConfig) -> dict[str, Any]:
    volumes, mounts = _volumes(spec)
    image = _image_fields(spec, config)
    coordinator = {
        "name": "coordinator",
        **image,
        "args": ["coordinator", *_model_flags(spec), "--port", str(COORDINATOR_PORT), "--routing", spec.routing],
        "env": _base_env(spec),
        "ports": [{"name": "coordinator", "containerPort": COORDINATOR_PORT, "protocol": "TCP"}],
        # The ROUTER socket is bound exactly while the coordinator process serves.
        "readinessProbe": {"tcpSocket": {"port": "coordinator"}, "periodSeconds": 5, "failureThreshold": 3},
        # Alive while its loop answers a STATUS within the probe's deadline: a stopped or spinning coordinator keeps
        # the port open (a tcpSocket probe passes) while it answers nobody; restarted after 30 s of that, as `run`
        # restarts a hung one.
        "livenessProbe": {"exec": {"command": ["python", "-m", "megatron_operator.probe", "coordinator"]},
                          "initialDelaySeconds": 10, "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 3},
        "resources": spec.coordinator_resources or DEFAULT_SIDE_RESOURCES,
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    server_env = _base_env(spec)
    tenancy_env, tenancy_args = server_tenancy(spec.tenants, spec.api_key_secret_ref, spec.server_tenancy)
    if spec.api_key_secret_ref and not spec.tenants:
        server_env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": spec.api_key_secret_ref["name"], "key": spec.api_key_secret_ref["key"]}}})
    server_env += tenancy_env  # spec.tenants: their keys and the key document (crd_tenants)
    probe_port: int | str = spec.probe_port or "http"
    server = {
        "name": "server",
        **image,
        "args": ["server", *_model_flags(spec), "--coordinator", f"tcp://127.0.0.1:{COORDINATOR_PORT}",
                 "--host", "0.0.0.0", "--port", str(spec.server_port), "--drain-timeout",
                 str(spec.drain_timeout_seconds), "--health-port", str(spec.probe_port), *_served_name(spec)]
                # on by default; the flag only when off, so existing pod templates stay unchanged
                + ([] if spec.remote_images else ["--no-remote-images"])
                + (["--api-server-count", str(spec.api_server_count)] if spec.api_server_count > 1 else [])
                + _scale_from_zero_flags(spec)
                + tenancy_args,
        "env": server_env,
        "ports": [{"name": "http", "containerPort": spec.server_port, "protocol": "TCP"}],
        # /ready: requests are served now (coordinator reachable, fleet RUNNING, not draining); /health: the
        # process answers and its event loop runs. A fleet paused for longer than 15 s takes this pod out of its
        # Service until it runs. On the probe port (not a declared port: no Service exposes it, the NetworkPolicy
        # admits no pod to it, and the kubelet probes from the node, which policies never block) they answer
        # within 100 ms under any load; on the HTTP port their p99 was 0.2-0.7 s under 400 streams (docs/benchmarks.md).
        "readinessProbe": {"httpGet": {"path": "/ready", "port": probe_port}, "periodSeconds": 5,
                           "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", "port": probe_port}, "initialDelaySeconds": 10,
                          "periodSeconds": 10, "failureThreshold": 6},
        # Let Service endpoints drop this pod before SIGTERM; then the server drains: new requests get 503,
        # admitted ones finish for up to drainTimeoutSeconds (within terminationGracePeriodSeconds).
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
        "resources": spec.server_resources or DEFAULT_SIDE_RESOURCES,
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(spec, coordinator_name(spec.name), "coordinator"),
        "spec": {
            "replicas": 1,
            # Never two coordinators at once: engines would split between them.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector_labels(spec.name, "coordinator")},
            "template": {
                "metadata": {"labels": labels(spec.name, "coordinator")},
                "spec": {**_pod_common(spec), **_init(spec, config, weights=False), "containers": [coordinator, server],
                         "volumes": volumes},
            },
        },
    }


def render_engine_service(spec: InferenceSpec, group: int) -> dict[str, Any]:
    # Ranks must find each other before any of them is ready.
    return service(spec, engine_name(spec.name, group), "engine",
                   [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": "rendezvous"}], group=group,
                   headless=True, publish_not_ready=True)


def _engine_probe(mode: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "exec": {"command": ["python", "-m", "megatron_operator.probe", mode]},
        "periodSeconds": period,
        "timeoutSeconds": 10,
        "failureThreshold": failures,
    }


# The pod ordinal of a StatefulSet pod is the suffix of its host name; a multi-pod group derives
# its node rank from it (then exec keeps the engine as PID 1, so it receives SIGTERM itself).
RANK_WRAPPER = ('ordinal="${HOSTNAME##*-}"; export NODE_RANK="$ordinal"; '
                'export RANK="$((ordinal * NPROC_PER_NODE))"; exec megatron-serve "$@"')
# A LeaderWorkerSet's pods get their index and their leader's address from the LWS controller's environment.
LWS_RANK_WRAPPER = ('export NODE_RANK="$LWS_WORKER_INDEX"; export RANK="$((LWS_WORKER_INDEX * NPROC_PER_NODE))"; '
                    'export MASTER_ADDR="${LWS_LEADER_ADDRESS:-$MASTER_ADDR}"; exec megatron-serve "$@"')


def engine_pod_template(spec: InferenceSpec, group: int, config: OperatorConfig,
                        wrapper: str = RANK_WRAPPER) -> dict[str, Any]:
    """The pod template of engine group ``group`` (its pods, their arguments, volumes and probes); a multi-pod
    group's pods derive their ranks with ``wrapper`` (:data:`RANK_WRAPPER`, :data:`LWS_RANK_WRAPPER`).

    Long: one manifest written top to bottom as Kubernetes reads it; the parts other objects share
    (volumes, model flags, addresses) are helpers already.
    """
    name = engine_name(spec.name, group)
    volumes, mounts = _volumes(spec)
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": ENGINE_SHM_LIMIT}})
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    lora_volumes, lora_mounts = _lora_volume(spec)
    disk_volumes, disk_mounts = disk_volume(spec)  # spec.engine.kvDiskTier
    volumes += lora_volumes + disk_volumes
    mounts += lora_mounts + disk_mounts
    pods = spec.pods_per_group
    gpus = spec.gpus_per_engine_pod
    args = [
        "engine", *_model_flags(spec),
        "--coordinator", coordinator_service_address(spec.name, spec.namespace),
        "--group", str(group),
    ]
    args += layout_flags(spec) + engine_flags(spec) + lora_flags(spec)
    kv_role = spec.kv_role(group)
    if kv_role is not None:  # vLLM's JSON, as ``run --prefill-engines`` gives it (megatron_serve.fleet.argv)
        args += kv_role_argv(kv_role)
    if spec.kv_memory_fraction is not None:
        args += ["--kv-cache-memory-fraction", repr(float(spec.kv_memory_fraction))]
    args += ["--drain-timeout", str(spec.drain_timeout_seconds)]
    env = _base_env(spec) + [
        {"name": "MEGATRON_SERVE_COORDINATOR", "value": coordinator_service_address(spec.name, spec.namespace)},
        {"name": "MEGATRON_SERVE_GROUP", "value": str(group)},
        {"name": "MASTER_ADDR", "value": f"{name}-0.{name}.{spec.namespace}.svc"},
        {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)},
        {"name": "WORLD_SIZE", "value": str(spec.ranks_per_group)},
        {"name": "NNODES", "value": str(pods)},
        {"name": "NPROC_PER_NODE", "value": str(gpus)},
        {"name": "LOCAL_RANK", "value": "0"},
    ]
    if pods == 1:
        env += [{"name": "NODE_RANK", "value": "0"}, {"name": "RANK", "value": "0"}]
    resources = with_host_tier(spec.engine_resources, spec.kv_offloading_size)
    for kind in ("limits", "requests"):
        resources.setdefault(kind, {})["nvidia.com/gpu"] = gpus
    container: dict[str, Any] = {
        "name": "engine",
        **_image_fields(spec, config),
    }
    if pods > 1:
        container["command"] = ["/bin/sh", "-c", wrapper, "megatron-serve"]
    container.update({
        "args": args,
        "env": env,
        "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
                  *events_container_ports(spec)],
        # Model loading can take long: the startup probe allows 30 minutes to register.
        "startupProbe": _engine_probe("registered", 10, 180),
        # Ready while the coordinator has this group registered.
        "readinessProbe": _engine_probe("registered", 15, 2),
        # Restart only when a reachable coordinator has dropped this group for two minutes.
        "livenessProbe": _engine_probe("alive", 30, 4),
        # SIGTERM makes the engine send DRAINING and finish or hand back its requests; waiting
        # for it here keeps the drain visible and bounded by terminationGracePeriodSeconds.
        "lifecycle": {"preStop": {"exec": {"command": [
            "/bin/sh", "-c", "kill -TERM 1; while kill -0 1 2>/dev/null; do sleep 1; done"]}}},
        "resources": resources,
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    })
    pod_spec: dict[str, Any] = {**_pod_common(spec), **_init(spec, config), "containers": [container],
                                "volumes": volumes}
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    return {"metadata": {"labels": labels(spec.name, "engine", group)}, "spec": pod_spec}


def render_engine_statefulset(spec: InferenceSpec, group: int, config: OperatorConfig,
                              engines_stopped: bool) -> dict[str, Any]:
    """The StatefulSet of engine group ``group``: pod 0 is the leader, found at its stable DNS name."""
    name = engine_name(spec.name, group)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": object_meta(spec, name, "engine", group),
        "spec": {
            "serviceName": name,
            "replicas": 0 if engines_stopped else spec.pods_per_group,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector_labels(spec.name, "engine", group)},
            "template": engine_pod_template(spec, group, config),
        },
    }


def render_engine_group(spec: InferenceSpec, group: int, config: OperatorConfig, engines_stopped: bool,
                        leader_worker_set: bool) -> list[dict[str, Any]]:
    """Group ``group``'s objects: a gang (``spec.engine.parallelism``) as a LeaderWorkerSet when
    ``leader_worker_set`` (its controller makes the headless Service), else the headless Service and a
    StatefulSet whose pod 0 leads."""
    if spec.gang and leader_worker_set:
        template = engine_pod_template(spec, group, config, LWS_RANK_WRAPPER)
        return [render_engine_lws(spec, engine_name(spec.name, group), group, template, engines_stopped)]
    return [render_engine_service(spec, group), render_engine_statefulset(spec, group, config, engines_stopped)]


def render_spec(spec: InferenceSpec, config: OperatorConfig | None = None, *, token: str | None = None,
                engines_stopped: bool | None = None, leader_worker_set: bool = False) -> list[dict[str, Any]]:
    """Children of an already parsed spec; see :func:`render`."""
    config = config or OperatorConfig()
    if token is None:
        token = derive_token(config.token_key, spec.namespace, spec.name, spec.uid)
    if engines_stopped is None:
        engines_stopped = spec.lifecycle == "Shutdown"
    objects = [
        render_secret(spec, token),
        render_server_service(spec),
        render_coordinator_service(spec),
        coordinator_policy(spec, config.operator_pod_labels),
        engine_policy(spec),
        render_coordinator_deployment(spec, config),
    ]
    events_service = render_events_service(spec)  # spec.engine.kvEvents
    if events_service is not None:
        objects.append(events_service)
    for group in range(spec.data):
        objects += render_engine_group(spec, group, config, engines_stopped, leader_worker_set)
    return objects + render_budgets(spec)  # spec.disruptionBudget


def render(resource: dict[str, Any], config: OperatorConfig | None = None, *, token: str | None = None,
           engines_stopped: bool | None = None, default_namespace: str = "default",
           leader_worker_set: bool = False) -> list[dict[str, Any]]:
    """The child objects of ``resource``, in a stable order.

    ``token`` keeps an existing coordinator token (default: derived from the resource identity).
    ``engines_stopped`` scales engine StatefulSets to zero (default: ``spec.lifecycle == Shutdown``);
    the operator holds it False until the coordinator has acknowledged STOP. ``leader_worker_set``: the
    cluster has the LeaderWorkerSet CRD (gangs are rendered as LeaderWorkerSets).
    Raises :class:`~megatron_operator.spec.SpecError` for an invalid resource.
    """
    spec = parse(resource, default_namespace=default_namespace)
    return render_spec(spec, config, token=token, engines_stopped=engines_stopped,
                       leader_worker_set=leader_worker_set)


# ----------------------------------------------------------------------------- the command

def to_yaml(objects: list[dict[str, Any]]) -> str:
    import yaml

    return yaml.safe_dump_all(objects, sort_keys=False, explicit_start=True, width=120)


def load_resources(text: str) -> list[dict[str, Any]]:
    import yaml

    docs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    out: list[dict[str, Any]] = []
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            out.extend(doc["items"])
        else:
            out.append(doc)
    return out


def render_file(path: str, config: OperatorConfig | None = None, strict_security: bool = True,
                leader_worker_set: bool = False) -> tuple[str, list[str]]:
    """Render every MegatronInference in a YAML file: (YAML stream, error lines). ``strict_security``: a
    resource whose children would leave a port open without credentials is an error
    (:func:`~megatron_operator.network.unauthenticated_ports`); ``leader_worker_set``: as :func:`render`."""
    import yaml

    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except OSError as exc:
        return "", [f"{path}: cannot read: {exc.strerror or exc}"]
    try:
        docs = load_resources(text)
    except yaml.YAMLError as exc:
        return "", [f"{path}: not valid YAML: {exc}"]
    if not docs:
        return "", [f"{path}: no resource found"]
    config = config or OperatorConfig.from_env()
    objects: list[dict[str, Any]] = []
    errors: list[str] = []
    for i, doc in enumerate(docs):
        label = f"{path}: document {i + 1}"
        if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict) and doc["metadata"].get("name"):
            label = f"{path}: {doc.get('kind', '?')}/{doc['metadata']['name']}"
        try:
            children = render(doc, config, leader_worker_set=leader_worker_set)
        except SpecError as exc:
            errors.extend(f"{label}: {reason}" for reason in exc.reasons)
            continue
        if strict_security:
            errors.extend(f"{label}: {problem} (or render with --no-strict-security)"
                          for problem in unauthenticated_ports(children))
        objects.extend(children)
    return (to_yaml(objects) if not errors else ""), errors


def add_render_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``megatron-serve render``."""
    parser.add_argument("-f", "--filename", required=True, metavar="FILE",
                        help="MegatronInference YAML ('-' reads stdin); may hold several documents")
    parser.add_argument("--strict-security", action=argparse.BooleanOptionalAction, default=True,
                        help="refuse a resource whose children would leave a port open to the cluster without "
                             "credentials (e.g. the OpenAI port without spec.server.apiKeySecretRef)")
    parser.add_argument("--leader-worker-set", action=argparse.BooleanOptionalAction, default=False,
                        help="render the engine groups of a resource with spec.engine.parallelism as LeaderWorkerSets "
                             "(leaderworkerset.x-k8s.io/v1), as the operator does where the cluster has that CRD; "
                             "default: StatefulSets")
    parser.add_argument("--token-key-file", metavar="PATH",
                        help="the operator's token key: the Secret then holds the token the operator derives "
                             f"(else ${ENV_TOKEN_KEY} or ${ENV_TOKEN_KEY_FILE}; none = a random token)")


def render_main(argv: list[str] | None = None) -> int:
    """``megatron-serve render -f FILE``: print the child objects, or the reasons and exit 1."""
    parser = argparse.ArgumentParser(prog="megatron-serve render",
                                     description="Print the child objects the operator would create.")
    add_render_arguments(parser)
    args = parser.parse_args(argv)
    return render_command(args.filename, token_key_file=args.token_key_file, strict_security=args.strict_security,
                          leader_worker_set=args.leader_worker_set)


def render_command(path: str, out: Any = None, err: Any = None, *, token_key_file: str | None = None,
                   strict_security: bool = True, leader_worker_set: bool = False) -> int:
    """Print the children of every resource in ``path``; the coordinator token comes from the operator's
    key when one is given, else it is random (never derived from public information), and stderr says so."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        config = OperatorConfig.from_env()
        key = read_secret_file(token_key_file, "--token-key-file") if token_key_file else token_key_from_env(os.environ)
    except ValueError as exc:
        print(f"megatron-serve render: error: {exc}", file=err)
        return 2
    if key is not None:
        config = dataclasses.replace(config, token_key=key)
    text, errors = render_file(path, config, strict_security, leader_worker_set)
    if errors:
        print(f"megatron-serve render: {path} is invalid:", file=err)
        for line in errors:
            print(f"  {line}", file=err)
        return 1
    if key is None:
        print(f"megatron-serve render: no token key given (--token-key-file, ${ENV_TOKEN_KEY} or "
              f"${ENV_TOKEN_KEY_FILE}): each Secret holds a new random token; give the operator's key to render "
              "the token the operator derives", file=err)
    out.write(text)
    return 0
