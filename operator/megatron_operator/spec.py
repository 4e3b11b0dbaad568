"""Validation, defaulting and a typed view of a ``MegatronInference`` resource (pure Python).

:func:`parse` applies the CRD schema of :mod:`megatron_operator.crd` the way the API server
does (structural checks, defaults, the CEL rules' Python twins), rejects unknown fields like
``kubectl``'s strict field validation, and returns an :class:`InferenceSpec`. Every problem is
reported as one readable line naming the field, all at once, in :class:`SpecError`.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any

from . import crd
from .crd_disaggregation import KV_ROLES, role_of


class SpecError(ValueError):
    """An invalid resource; ``reasons`` lists one readable line per problem."""

    def __init__(self, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__("; ".join(self.reasons))


# --------------------------------------------------------------------------- structural schema

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
}


def _type_ok(value: Any, schema: dict[str, Any]) -> bool:
    if schema.get("x-kubernetes-int-or-string"):
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    kind = schema.get("type")
    if kind is None:
        return True
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


#: What a spec's value is called in an error, by type (``bool`` before ``int``: a boolean is an int to Python).
_KINDS: tuple[tuple[type, str], ...] = ((bool, "a boolean"), (int, "an integer"), (float, "a number"),
                                        (str, "a string"), (list, "a list"), (dict, "an object"))


def _describe(value: Any) -> str:
    return next((words for kind, words in _KINDS if isinstance(value, kind)), type(value).__name__)


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Fill in schema defaults in place (objects defaulted to {} get their nested defaults too)."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                apply_defaults(value[name], sub)
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for item in value.values():
            apply_defaults(item, schema["additionalProperties"])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            apply_defaults(item, schema["items"])
    return value


def check_schema(value: Any, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    """Append one readable line per structural problem of ``value`` at ``path``."""
    where = path or "(root)"
    if not _type_ok(value, schema):
        expected = "an integer or a string" if schema.get("x-kubernetes-int-or-string") else \
            {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "a boolean",
             "object": "an object", "array": "a list"}[schema["type"]]
        errors.append(f"{where}: must be {expected}, got {_describe(value)} {value!r}")
        return
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(str(v) for v in schema["enum"])
        errors.append(f"{where}: unsupported value {value!r}; must be one of: {allowed}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema:
            low = schema["minimum"]
            if schema.get("exclusiveMinimum") and not value > low:
                errors.append(f"{where}: must be greater than {low}, got {value}")
            elif value < low:
                errors.append(f"{where}: must be at least {low}, got {value}")
        if "maximum" in schema:
            high = schema["maximum"]
            if schema.get("exclusiveMaximum") and not value < high:
                errors.append(f"{where}: must be less than {high}, got {value}")
            elif value > high:
                errors.append(f"{where}: must be at most {high}, got {value}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{where}: must not be empty" if schema["minLength"] == 1
                          else f"{where}: must be at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{where}: must be at most {schema['maxLength']} characters")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            hint = "must be an absolute path" if schema["pattern"] == "^/" else f"must match {schema['pattern']}"
            errors.append(f"{where}: {hint}, got {value!r}")
    if isinstance(value, dict):
        props = schema.get("properties")
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{path + '.' if path else ''}{name}: required field is missing")
        if props is not None:
            for name, item in value.items():
                sub_path = f"{path}.{name}" if path else name
                if name in props:
                    check_schema(item, props[name], sub_path, errors)
                elif not schema.get("x-kubernetes-preserve-unknown-fields"):
                    errors.append(f"{sub_path}: unknown field")
        elif isinstance(schema.get("additionalProperties"), dict):
            for name, item in value.items():
                check_schema(item, schema["additionalProperties"], f"{path}.{name}", errors)
    if isinstance(value, list) and "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(f"{where}: must have at most {schema['maxItems']} items, got {len(value)}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            check_schema(item, schema["items"], f"{path}[{i}]", errors)
    if isinstance(value, list) and schema.get("x-kubernetes-list-type") == "map":
        _check_map_keys(value, schema["x-kubernetes-list-map-keys"], path, errors)


def _check_map_keys(items: list[Any], keys: list[str], path: str, errors: list[str]) -> None:
    """A list of ``x-kubernetes-list-type: map``: the API server refuses two items of one key."""
    seen: set[tuple[Any, ...]] = set()
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        key = tuple(item.get(k) for k in keys)
        if key in seen:
            named = ", ".join(f"{k} {v!r}" for k, v in zip(keys, key))
            errors.append(f"{path}[{i}]: duplicate value ({named}): each item's {', '.join(keys)} must be unique")
        seen.add(key)


def _check_cel(value: Any, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    """Evaluate the Python twins of the CEL rules, depth first, like the API server."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name in value and name != "metadata":
                _check_cel(value[name], sub, f"{path}.{name}" if path else name, errors)
    for rule in schema.get("x-kubernetes-validations", []):
        try:
            ok = crd.CEL_CHECKS[rule["rule"]](value)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            ok = False
        if not ok:
            errors.append(f"{path or '(root)'}: {rule['message']}")


def validate(resource: dict[str, Any]) -> dict[str, Any]:
    """Return a defaulted deep copy of ``resource`` or raise :class:`SpecError` with all reasons."""
    if not isinstance(resource, dict):
        raise SpecError([f"a resource must be a mapping, got {_describe(resource)}"])
    errors: list[str] = []
    if resource.get("apiVersion") != crd.API_VERSION:
        errors.append(f"apiVersion: must be {crd.API_VERSION}, got {resource.get('apiVersion')!r}")
    if resource.get("kind") != crd.KIND:
        errors.append(f"kind: must be {crd.KIND}, got {resource.get('kind')!r}")
    meta = resource.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta.get("name"):
        errors.append("metadata.name: required field is missing")
    elif not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"]):
        errors.append(f"metadata.name: {meta['name']!r} must be a DNS label (lower-case letters, digits and '-')")
    if errors:
        raise SpecError(errors)
    schema = crd.openapi_schema()
    obj = copy.deepcopy(resource)
    obj.pop("status", None)
    apply_defaults(obj, schema)
    check_schema({k: v for k, v in obj.items() if k != "metadata"}, {**schema, "required": ["spec"]}, "", errors)
    if not errors:
        _check_cel(obj, schema, "", errors)
    if errors:
        raise SpecError(errors)
    return obj


# --------------------------------------------------------------------------- typed view

@dataclass(frozen=True)
class InferenceSpec:
    """The defaulted spec of one resource, with the derived numbers that rendering needs."""

    name: str
    namespace: str
    uid: str | None
    generation: int | None
    image: str | None
    image_pull_policy: str | None
    image_pull_secrets: list[dict[str, Any]]
    model_path: str
    model_hub: str | None  # a Hub id an init container fetches into model_path
    hub_token_secret_ref: dict[str, str] | None
    model_volume: dict[str, Any] | None
    model_mount_path: str
    model_revision: str | None
    dtype: str
    max_sequence_length: int | None
    tensor: int  # ranks of one pipeline stage (engine.parallelism's, else spec.parallelism's)
    pipeline: int
    data: int
    expert: int  # 1, or tensor: whole experts on every rank of a stage
    all2all_backend: str  # the engines' --all2all-backend (auto: theirs)
    data_parallel_attention: int  # attention ranks per stage (each tensor / data_parallel_attention wide)
    gang: bool  # spec.engine.parallelism is set: each group is rendered as a gang (docs/parallelism.md)
    gpus_per_pod: int
    block_size_tokens: int | None
    kv_memory_fraction: float | None
    prefix_caching: bool
    max_batch_tokens: int | None
    cuda_graphs: bool
    batch_invariant: bool
    quantization: str  # none or fp8
    kv_cache_dtype: str  # auto or fp8
    kv_offloading_size: float | None  # GiB of host memory for the engines' host KV tier; None: no tier
    kv_on_refit: str | None  # the engines' --kv-on-refit; None: their default (recompute)
    kv_disk_tier: dict[str, Any] | None  # spec.engine.kvDiskTier as given (None: no disk tier; kv_node)
    kv_events: dict[str, Any] | None  # spec.engine.kvEvents, defaulted (None: the engines publish none; kv_node)
    speculative: dict[str, Any] | None  # spec.engine.speculative as given (camelCase), None: off
    prefill_replicas: int  # spec.engine.disaggregation's prefill groups; 0: not disaggregated
    decode_replicas: int
    engine_resources: dict[str, Any]
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    affinity: dict[str, Any] | None
    priority_class_name: str | None
    routing: str
    coordinator_resources: dict[str, Any]
    server_port: int
    probe_port: int  # the server's --health-port; 0: none, the probes use server_port
    api_key_secret_ref: dict[str, str] | None
    tenants: list[dict[str, Any]]  # spec.tenants as given, defaulted (crd_tenants renders them for the server)
    server_tenancy: dict[str, Any]  # spec.server's tenantHeader and shedding, as given
    server_resources: dict[str, Any]
    api_server_count: int
    remote_images: bool
    scale_from_zero: dict[str, int]  # spec.server.scaleFromZero, defaulted (timeoutSeconds 0: off)
    lora: dict[str, Any] | None  # spec.lora, defaulted (None: no LoRA)
    trainers: list[dict[str, Any]]  # NetworkPolicy peers admitted to the coordinator port and the engine pods
    lifecycle: str
    pause_mode: str  # megatron_serve.wire.lifecycle.PauseMode's value: keep, wait, abort
    suspend_keep_kv: bool  # every SUSPEND keeps the requests in flight's KV in host memory
    drain_timeout_seconds: int
    disruption_budget: dict[str, Any]  # spec.disruptionBudget, defaulted (enabled, maxUnavailableGroups, ...)
    progress_deadline_seconds: int  # spec.rollout.progressDeadlineSeconds: a group not Ready by then halts a rollout
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def ranks_per_group(self) -> int:
        """World size of one engine group: tensor * pipeline."""
        return self.tensor * self.pipeline

    def role(self, group: int) -> str | None:
        """Engine group ``group``'s role, prefill or decode (None: not disaggregated, it does both)."""
        return role_of(group, self.prefill_replicas) if self.prefill_replicas else None

    def kv_role(self, group: int) -> str | None:
        """The ``kv_role`` of group ``group``'s ``--kv-transfer-config`` (None: the flag is left out)."""
        role = self.role(group)
        return None if role is None else KV_ROLES[role]

    @property
    def gpus_per_engine_pod(self) -> int:
        """GPUs requested by each engine pod (a group smaller than a node takes only what it needs). With
        data-parallel attention a pod is one attention rank's engine, which starts its own ``attention_tensor``
        ranks (and only those), so a pod holds exactly that many GPUs."""
        if self.data_parallel_attention > 1:
            return self.attention_tensor
        return min(self.gpus_per_pod, self.ranks_per_group)

    @property
    def pods_per_group(self) -> int:
        return math.ceil(self.ranks_per_group / self.gpus_per_engine_pod)

    @property
    def attention_tensor(self) -> int:
        """Tensor-parallel width of one attention rank: the engines' ``--tensor-parallel-size``."""
        return self.tensor // self.data_parallel_attention


def hub_model_path(mount_path: str, hub: str) -> str:
    """Where a Hub model is fetched when ``spec.model.path`` is not given: ``<mount>/<org>/<name>[@<revision>]``."""
    return f"{mount_path.rstrip('/')}/{hub}"


def parse(resource: dict[str, Any], default_namespace: str = "default") -> InferenceSpec:
    """Validate and default ``resource``; raise :class:`SpecError` listing every problem."""
    obj = validate(resource)
    meta = obj["metadata"]
    spec = obj["spec"]
    model, engine = spec["model"], spec["engine"]
    par = {**spec["parallelism"], **engine.get("parallelism", {})}
    kv = engine["kvCache"]
    server = spec["server"]
    return InferenceSpec(
        name=meta["name"],
        namespace=meta.get("namespace") or default_namespace,
        uid=meta.get("uid"),
        generation=meta.get("generation"),
        image=spec.get("image"),
        image_pull_policy=spec.get("imagePullPolicy"),
        image_pull_secrets=list(spec.get("imagePullSecrets", [])),
        model_path=model.get("path") or hub_model_path(model["mountPath"], model["hub"]),
        model_hub=model.get("hub"),
        hub_token_secret_ref=model.get("hubTokenSecretRef"),
        model_volume=model.get("volume"),
        model_mount_path=model["mountPath"],
        model_revision=model.get("revision"),
        dtype=model["dtype"],
        max_sequence_length=model.get("maxSequenceLength"),
        tensor=par["tensor"],
        pipeline=par["pipeline"],
        data=par["data"],
        expert=par.get("expert", 1),
        all2all_backend=par.get("all2allBackend", "auto"),
        data_parallel_attention=par.get("dataParallelAttention", 1),
        gang="parallelism" in engine,
        gpus_per_pod=engine["gpusPerPod"],
        block_size_tokens=kv.get("blockSizeTokens"),
        kv_memory_fraction=kv.get("memoryFraction"),
        prefix_caching=kv["prefixCaching"],
        max_batch_tokens=engine.get("maxBatchTokens"),
        cuda_graphs=engine["cudaGraphs"],
        batch_invariant=engine["batchInvariant"],
        quantization=engine["quantization"],
        kv_cache_dtype=engine["kvCacheDtype"],
        kv_offloading_size=engine.get("kvOffloadingSize"),
        kv_on_refit=engine.get("kvOnRefit"),
        kv_disk_tier=dict(engine["kvDiskTier"]) if "kvDiskTier" in engine else None,
        kv_events=dict(engine["kvEvents"]) if "kvEvents" in engine else None,
        speculative=dict(engine["speculative"]) if "speculative" in engine else None,
        prefill_replicas=engine.get("disaggregation", {}).get("prefillReplicas", 0),
        decode_replicas=engine.get("disaggregation", {}).get("decodeReplicas", 0),
        engine_resources=dict(engine.get("resources", {})),
        node_selector=dict(engine.get("nodeSelector", {})),
        tolerations=list(engine.get("tolerations", [])),
        affinity=engine.get("affinity"),
        priority_class_name=engine.get("priorityClassName"),
        routing=spec["coordinator"]["routing"],
        coordinator_resources=dict(spec["coordinator"].get("resources", {})),
        server_port=server["port"],
        probe_port=server["probePort"],
        api_key_secret_ref=server.get("apiKeySecretRef"),
        tenants=[dict(tenant) for tenant in spec.get("tenants", [])],
        server_tenancy={k: server[k] for k in ("tenantHeader", "shedding") if k in server},
        server_resources=dict(server.get("resources", {})),
        api_server_count=server["apiServerCount"],
        remote_images=server["remoteImages"],
        scale_from_zero={"timeoutSeconds": 0, "queue": 256, **server.get("scaleFromZero", {})},
        lora=spec.get("lora"),
        trainers=[dict(peer) for peer in spec["network"].get("trainers", [])],
        lifecycle=spec["lifecycle"],
        pause_mode=spec["pauseMode"].lower(),
        suspend_keep_kv=spec["suspendKeepKV"],
        drain_timeout_seconds=spec["drainTimeoutSeconds"],
        disruption_budget=dict(spec["disruptionBudget"]),
        progress_deadline_seconds=spec["rollout"]["progressDeadlineSeconds"],
        raw=obj,
    )
