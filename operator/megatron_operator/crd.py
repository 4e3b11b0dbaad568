"""The ``MegatronInference`` CustomResourceDefinition (docs/reference/megatroninference.md), as data.

This module is the single source of the CRD: ``manifests/crds/`` and the chart's ``crds/``
folder hold its YAML form (``python -m megatron_operator.crd`` prints it; a test keeps the files
identical), and :mod:`megatron_operator.spec` validates and defaults resources with the very
same schema, so ``render`` and the operator agree with the API server.

CEL rules (``x-kubernetes-validations``) carry a Python twin (:data:`CEL_CHECKS`) used by the
operator, which cannot depend on a CEL evaluator; tests evaluate the real CEL expressions with
``cel-python`` and check that both agree on every example and on a set of bad resources.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

from . import crd_disaggregation, crd_kv_tiers, crd_layout, crd_rollout, crd_speculative, crd_tenants
from .crd_fields import free_field, int_field, obj_field, secret_key_field, str_field, volume_field

GROUP = "serving.megatron.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MegatronInference"
PLURAL = "megatroninferences"
SINGULAR = "megatroninference"
SHORT_NAMES = ["mi"]
CRD_NAME = f"{PLURAL}.{GROUP}"

LIFECYCLES = ["Running", "Paused", "Suspended", "Shutdown"]
PAUSE_MODES = ["Keep", "Wait", "Abort"]  # megatron_serve.wire.lifecycle.PauseMode, named the resource's way
PHASES = ["Pending", "Progressing", "Ready", "Paused", "Suspended", "Shutdown", "Degraded", "Failed"]
DTYPES = ["bfloat16", "float16", "float32"]
ROUTINGS = ["least_loaded", "round_robin", "prefix_affinity"]
QUANTIZATIONS = ["none", "fp8"]  # the engine's --quantization (none: the checkpoint as it is)
KV_CACHE_DTYPES = ["auto", "fp8"]  # the engine's --kv-cache-dtype
CONDITION_TYPES = ["Ready", "CoordinatorReady", "EnginesReady", "LifecycleSynced", "Progressing", "SpecValid"]

COORDINATOR_PORT = 5555
# Longest resource name: "<name>-engine-<g>" must stay a valid StatefulSet name whose pods'
# controller-revision-hash label ("<sts>-<10 chars>") fits in 63 characters, with g < 1000.
MAX_NAME_LENGTH = 40
MAX_DATA = 256


_QUANTITY = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
    "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
}


def _resources(description: str) -> dict[str, Any]:
    quantities = {"type": "object", "additionalProperties": copy.deepcopy(_QUANTITY)}
    return obj_field(description, {
        "limits": {**quantities, "description": "Maximum amount of compute resources allowed."},
        "requests": {**quantities, "description": "Minimum amount of compute resources required."},
    })


# --------------------------------------------------------------------------- CEL rules + twins

# Each rule: (schema path of the object it is attached to, CEL rule, message, python twin).
# The twin receives the (defaulted) object the rule is attached to, like CEL's ``self``.
CelCheck = Callable[[dict[str, Any]], bool]


def _ranks(spec: dict[str, Any]) -> int:
    par = spec.get("parallelism", {})
    return int(par.get("tensor", 1)) * int(par.get("pipeline", 1))


def _gpus_rule(spec: dict[str, Any]) -> bool:
    ranks = _ranks(spec)
    gpus = int(spec.get("engine", {}).get("gpusPerPod", 8))
    return ranks % gpus == 0 or gpus % ranks == 0


def _probe_port_rule(server: dict[str, Any]) -> bool:
    probe = server.get("probePort", 0)  # defaulted (8001) before the rules run, as by the API server
    return probe == 0 or int(probe) not in (int(server.get("port", 8000)), COORDINATOR_PORT)


#: A Hugging Face Hub id with an optional revision (``megatron_serve.model.hub`` reads the same shape).
HUB_ID_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?/[A-Za-z0-9_.-]*[A-Za-z0-9_](@[A-Za-z0-9_./-]+)?$"


#: A LoRA adapter's name: what requests give as their model (no '=', which --lora-modules NAME=PATH splits at).
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:/-]*$"


def _model_path_rule(model: dict[str, Any]) -> bool:
    if "path" not in model or ("volume" not in model and "hub" not in model):
        return True
    mount = model.get("mountPath", "/models")
    path = model["path"]
    return path == mount or path.startswith(mount + "/")


CEL_RULES: list[tuple[str, str, str, CelCheck]] = [
    (
        "",
        f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
        f"metadata.name must be at most {MAX_NAME_LENGTH} characters (child names append '-engine-<group>')",
        lambda obj: len(obj.get("metadata", {}).get("name", "")) <= MAX_NAME_LENGTH,
    ),
    (
        "",
        "self.metadata.name.matches('^[a-z]')",
        "metadata.name must start with a lower-case letter (it names Services)",
        lambda obj: obj.get("metadata", {}).get("name", "")[:1].isalpha()
        and obj.get("metadata", {}).get("name", "")[:1].islower(),
    ),
    (
        "spec",
        "(self.parallelism.tensor * self.parallelism.pipeline) % self.engine.gpusPerPod == 0"
        " || self.engine.gpusPerPod % (self.parallelism.tensor * self.parallelism.pipeline) == 0",
        "parallelism.tensor * parallelism.pipeline must be a multiple or a divisor of engine.gpusPerPod",
        _gpus_rule,
    ),
    (
        "spec",
        f"self.server.port != {COORDINATOR_PORT}",
        f"server.port must differ from the coordinator port {COORDINATOR_PORT} (both run in one pod)",
        lambda spec: int(spec.get("server", {}).get("port", 8000)) != COORDINATOR_PORT,
    ),
    (
        "spec",
        f"!has(self.server.probePort) || self.server.probePort == 0 || (self.server.probePort != self.server.port "
        f"&& self.server.probePort != {COORDINATOR_PORT})",
        f"server.probePort must differ from server.port and from the coordinator port {COORDINATOR_PORT} (all run in "
        "one pod)",
        lambda spec: _probe_port_rule(spec.get("server", {})),
    ),
    (
        "spec.model",
        "!has(self.path) || (!has(self.volume) && !has(self.hub)) || self.path == self.mountPath"
        " || self.path.startsWith(self.mountPath + '/')",
        "model.path must lie inside model.mountPath when model.volume or model.hub is set",
        _model_path_rule,
    ),
    (
        "spec.model",
        "has(self.path) || has(self.hub)",
        "model needs path (a model directory in the pods) or hub (a Hugging Face Hub id to fetch)",
        lambda model: "path" in model or "hub" in model,
    ),
    (
        "spec.model",
        "!has(self.hubTokenSecretRef) || has(self.hub)",
        "model.hubTokenSecretRef applies to model.hub only",
        lambda model: "hubTokenSecretRef" not in model or "hub" in model,
    ),
    (
        "spec.lora",
        "!has(self.volume) || size(self.volume) == 1",
        "lora.volume must name exactly one volume source, e.g. {persistentVolumeClaim: {claimName: adapters}}",
        lambda lora: "volume" not in lora or len(lora["volume"]) == 1,
    ),
    (
        "spec.lora",
        "self.adapters.all(a, self.adapters.exists_one(b, b.name == a.name))",
        "lora.adapters must have distinct names (a request's model picks the adapter by its name)",
        lambda lora: len({a["name"] for a in lora.get("adapters", [])}) == len(lora.get("adapters", [])),
    ),
    (
        "spec.lora",
        "!has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras",
        "lora.maxCpuLoras must be at least lora.maxLoras (every adapter in a device slot is also held in host "
        "memory; the engines refuse fewer)",
        lambda lora: "maxCpuLoras" not in lora or int(lora["maxCpuLoras"]) >= int(lora.get("maxLoras", 1)),
    ),
    (
        "spec.model",
        "!has(self.volume) || size(self.volume) == 1",
        "model.volume must name exactly one volume source, e.g. {persistentVolumeClaim: {claimName: models}}",
        lambda model: "volume" not in model or len(model["volume"]) == 1,
    ),
]

CEL_RULES += crd_layout.CEL_RULES + crd_disaggregation.CEL_RULES + crd_kv_tiers.CEL_RULES + crd_speculative.CEL_RULES

# rule text -> python twin (the operator evaluates these; tests compare them with real CEL)
CEL_CHECKS: dict[str, CelCheck] = {rule: check for _, rule, _, check in CEL_RULES}


def _rules_for(path: str) -> list[dict[str, str]]:
    return [{"rule": rule, "message": message} for where, rule, message, _ in CEL_RULES if where == path]


# --------------------------------------------------------------------------- the schema

def spec_schema() -> dict[str, Any]:
    """The CRD's ``spec`` schema with every field's description.

    Long: one literal, field by field in the order ``kubectl explain`` shows them; split, it would read as
    fragments of one document.
    """
    model = obj_field(
        "The Hugging Face model the engines serve: a directory in the pods (path), or a Hub id (hub) that an init "
        "container of every pod fetches into the model volume.",
        {
            "path": str_field("Absolute path of the HF model directory, or of a GGUF file (*.gguf), inside the pods "
                              "(inside mountPath when volume or hub is set). With hub, where the files are fetched to "
                              "(default: <mountPath>/<org>/<name>[@<revision>]).",
                              minLength=1, maxLength=4096, pattern="^/"),
            "hub": str_field("Hugging Face Hub id, org/name or org/name@revision (branch, tag or commit): an init "
                             "container (`megatron-serve download`) fetches it into the model volume before the "
                             "coordinator and engines start. Without volume, each pod fetches into its own emptyDir; "
                             "a writable shared volume (e.g. a ReadWriteMany PVC) fetches once.",
                             maxLength=300, pattern=HUB_ID_PATTERN),
            "hubTokenSecretRef": secret_key_field("Secret key holding an HF_TOKEN for gated or private Hub models."),
            "volume": volume_field("Any Kubernetes volume source holding the model, e.g. "
                                   "{persistentVolumeClaim: {claimName: models}}; mounted read-only at mountPath (the "
                                   "hub init container mounts it writable)."),
            "mountPath": str_field("Where the model volume is mounted.", default="/models",
                                   minLength=1, maxLength=1024, pattern="^/"),
            "dtype": str_field("Weight and activation dtype.", enum=list(DTYPES), default="bfloat16"),
            "maxSequenceLength": int_field("Longest prompt + generation, in tokens.", minimum=1),
            "revision": str_field("Optional label of the weights at path (e.g. a training step or commit). Changing "
                                  "path or revision on a running resource refits the weights in place (PAUSE, REFIT, "
                                  "UNPAUSE) when the architecture is unchanged, else rolls the pods.",
                                  maxLength=253),
        },
    )
    model["x-kubernetes-validations"] = _rules_for("spec.model")
    parallelism = obj_field(
        "Parallel layout: data = number of engine groups, each tensor*pipeline GPUs (engine.parallelism, when set, "
        "gives a group's layout instead of tensor and pipeline).",
        {
            "tensor": int_field("Tensor-parallel ranks per engine group.", minimum=1, maximum=64, default=1),
            "pipeline": int_field("Pipeline-parallel stages per engine group. Reserved: the engine runs one stage, "
                                  "so only 1 is accepted.", minimum=1, maximum=1, default=1),
            "data": int_field("Number of engine groups (data-parallel replicas); scaled by the scale subresource.",
                              minimum=0, maximum=MAX_DATA, default=1),
        },
        default={},
    )
    engine = obj_field(
        "Engine pods.",
        {
            "gpusPerPod": int_field("GPUs per node/pod; pods per group = ceil(tensor*pipeline / gpusPerPod) (with "
                                    "engine.parallelism.dataParallelAttention: one pod of tensor / "
                                    "dataParallelAttention GPUs per attention rank).",
                                    minimum=1, maximum=16, default=8),
            "kvCache": obj_field(
                "Paged KV cache.",
                {
                    "blockSizeTokens": int_field("Tokens per KV block.", minimum=1, maximum=4096),
                    "memoryFraction": {"type": "number", "description": "Fraction of free GPU memory for the KV pool.",
                                       "minimum": 0, "exclusiveMinimum": True, "maximum": 1},
                    "prefixCaching": {"type": "boolean", "description": "Share KV blocks of common prefixes.",
                                      "default": True},
                },
                default={},
            ),
            "maxBatchTokens": int_field("Token budget of one engine step.", minimum=1),
            "cudaGraphs": {"type": "boolean", "default": True,
                           "description": "Replay decode steps from CUDA graphs (false: every step runs eagerly)."},
            "batchInvariant": {"type": "boolean", "default": False,
                               "description": "Batch-invariant mode (--batch-invariant): a request's logits, log "
                                              "probs and tokens are bitwise its own whatever else shares the engine's "
                                              "steps, and equal to a trainer's forward under "
                                              "megatron_serve.invariant. Changing it rolls the engine pods."},
            "quantization": str_field("fp8: quantize a bf16 checkpoint's linear layers to FP8 when the engines load it "
                                      "(one scale per output row, activations per token; about half the weight "
                                      "memory). FP8 checkpoints (compressed-tensors, block-wise fp8) are served as FP8 "
                                      "without it. Changing it rolls the engine pods.",
                                      enum=list(QUANTIZATIONS), default="none"),
            "kvCacheDtype": str_field("fp8: KV cache in e4m3 with a scale per token and KV head, about twice the "
                                      "tokens in the same memory; auto: the model dtype. Changing it rolls the "
                                      "engine pods.",
                                      enum=list(KV_CACHE_DTYPES), default="auto"),
            **crd_kv_tiers.kv_tier_fields(),
            "speculative": {**crd_speculative.speculative_schema(),
                            "x-kubernetes-validations": _rules_for("spec.engine.speculative")},
            "parallelism": {**crd_layout.parallelism_schema(),
                            "x-kubernetes-validations": _rules_for("spec.engine.parallelism")},
            "disaggregation": crd_disaggregation.disaggregation_schema(),
            "resources": _resources("CPU/memory for each engine pod; nvidia.com/gpu is set by the operator."),
            "nodeSelector": {"type": "object", "description": "Node selector for engine pods.",
                             "additionalProperties": {"type": "string"}},
            "tolerations": {"type": "array", "description": "Tolerations for engine pods.",
                            "items": free_field("A Kubernetes Toleration.")},
            "affinity": free_field("A Kubernetes Affinity for engine pods."),
            "priorityClassName": str_field("PriorityClass of engine pods.", maxLength=253),
        },
        default={},
    )
    engine["x-kubernetes-validations"] = _rules_for("spec.engine")
    coordinator = obj_field(
        "The coordinator process (routing, lifecycle; prompts arrive tokenized).",
        {
            "routing": str_field("Routing policy.", enum=list(ROUTINGS), default="least_loaded"),
            "resources": _resources("Resources of the coordinator container."),
        },
        default={},
    )
    server = obj_field(
        "The OpenAI-compatible HTTP server (runs in the coordinator pod).",
        {
            "port": int_field("HTTP port of the server and its Service.", minimum=1, maximum=65535, default=8000),
            "probePort": int_field("Port of the server's probe port (--health-port): /health and /ready answered by "
                                   "a process of its own, within 100 ms however busy the streams keep the HTTP port "
                                   "(there their p99 was 0.2-0.7 s under 400 streams). The pod's liveness and "
                                   "readiness probes use it; no Service exposes it and no pod is admitted to it (the "
                                   "kubelet's probes come from the node). 0: no probe port, the probes use the HTTP "
                                   "port.",
                                   minimum=0, maximum=65535, default=8001),
            "apiKeySecretRef": secret_key_field("Secret key holding the API key clients must send."),
            "resources": _resources("Resources of the server container."),
            **crd_tenants.server_fields(),
            "apiServerCount": int_field("HTTP server processes in the server container, sharing its port, each with "
                                        "its own coordinator client (vLLM's --api-server-count): for more streamed "
                                        "tokens per second than one process writes. Give the container about one CPU "
                                        "per process; /metrics stays fleet-wide.", minimum=1, maximum=64, default=1),
            "scaleFromZero": obj_field(
                "Hold requests at the server while the fleet has no engine group (spec.parallelism.data scaled to 0 "
                "by KEDA's minReplicaCount: 0 or an HPA): the server's --scale-from-zero-timeout and "
                "--scale-from-zero-queue. While it holds and its queue has room the pod stays Ready (its /ready is "
                "200 with held true), so the Service sends the request that asks for the first group "
                "(megatron_serve_engine_groups_wanted). Off (timeoutSeconds 0) for a fleet that is not scaled to "
                "zero: without engines its server pod is not Ready.",
                {"timeoutSeconds": int_field("How long a request waits for a first engine (the model's cold start); "
                                             "0: holding is off.", minimum=0, maximum=3600, default=0),
                 "queue": int_field("Requests that may wait at once; past it 503 no_engine and the pod not Ready.",
                                    minimum=0, maximum=100000, default=256)},
                default={},
            ),
            "remoteImages": {"type": "boolean", "default": True,
                             "description": "Fetch http(s) image URLs of chat requests (vision-language models); "
                                            "false: only data: URLs, so the server never reaches into the cluster "
                                            "network on a client's behalf."},
        },
        default={},
    )
    lora = obj_field(
        "LoRA adapters (PEFT checkpoints) the engines serve beside the base model, from a volume: every engine starts "
        "with --enable-lora and --lora-modules NAME=PATH for each adapter, and a request picks one by giving its "
        "name as its model (docs/lora.md). Adding, removing or changing an adapter rolls the engine pods.",
        {
            "adapters": {"type": "array", "default": [], "maxItems": 256,
                         "description": "The adapters served from the start (vLLM's --lora-modules).",
                         "items": obj_field("One adapter.", {
                             "name": str_field("The name requests give as their model; listed in /v1/models with the "
                                               "base model as its parent.", minLength=1, maxLength=253,
                                               pattern=LORA_NAME_PATTERN),
                             "path": str_field("Absolute path of the adapter's directory (adapter_config.json and "
                                               "adapter_model.safetensors) in the engine pods: inside mountPath when "
                                               "volume is set, or inside the model volume.",
                                               minLength=1, maxLength=4096, pattern="^/"),
                         }, required=["name", "path"])},
            "volume": volume_field("Any Kubernetes volume source holding the adapters, e.g. "
                                   "{persistentVolumeClaim: {claimName: adapters}}; mounted read-only at mountPath in "
                                   "the engine pods."),
            "mountPath": str_field("Where the adapter volume is mounted.", default="/adapters",
                                   minLength=1, maxLength=1024, pattern="^/"),
            "maxLoras": int_field("Adapter slots on each engine's device: the most adapters one step mixes (vLLM's "
                                  "--max-loras).", minimum=1, maximum=256, default=1),
            "maxLoraRank": int_field("Largest adapter rank served (vLLM's --max-lora-rank); a larger adapter is "
                                     "refused with its name.", minimum=1, maximum=512, default=16),
            "maxCpuLoras": int_field("Adapters each engine keeps in host memory (vLLM's --max-cpu-loras; default: "
                                     "enough for maxLoras and every listed adapter).", minimum=1, maximum=4096),
        },
    )
    lora["x-kubernetes-validations"] = _rules_for("spec.lora")
    network = obj_field(
        "Who may reach the fleet's pods besides the fleet itself and the operator. Every container port of every "
        "child is covered by a NetworkPolicy: the coordinator port admits the fleet's pods, the operator and these "
        "peers; the engine pods admit each other and these peers; the OpenAI port admits everyone (it takes the API "
        "key).",
        {
            "trainers": {"type": "array",
                         "description": "NetworkPolicy peers (podSelector and/or namespaceSelector) of the trainer "
                                        "pods of an RL fleet: admitted to the coordinator port (with the fleet secret "
                                        "they submit rollouts, pause and refit) and to the engine pods (the weight "
                                        "transfer's collective connects there).",
                         "items": free_field("A Kubernetes NetworkPolicyPeer.")},
        },
        default={},
    )
    spec = obj_field(
        "Desired state of a served model.",
        {
            "image": str_field("Runtime image; the operator's default when omitted.", minLength=1, maxLength=1024),
            "imagePullPolicy": str_field("Image pull policy.", enum=["Always", "IfNotPresent", "Never"]),
            "imagePullSecrets": {"type": "array", "description": "Secrets to pull the image.",
                                 "items": obj_field("A LocalObjectReference.",
                                                    {"name": str_field("Secret name.", minLength=1, maxLength=253)},
                                                    required=["name"])},
            "model": model,
            "parallelism": parallelism,
            "engine": engine,
            "coordinator": coordinator,
            "server": server,
            "tenants": crd_tenants.tenants_schema(),
            "lora": lora,
            "network": network,
            "lifecycle": str_field("Running | Paused (stop stepping, keep memory) | Suspended (release GPU memory) | "
                                   "Shutdown (stop engines, scale them to zero).", enum=list(LIFECYCLES),
                                   default="Running"),
            "pauseMode": str_field("What every PAUSE the lifecycle walk sends (towards Paused or Suspended) does with "
                                   "the requests in flight: Keep (pause them in place; they continue after Running), "
                                   "Wait (let running requests finish first, for at most drainTimeoutSeconds; queued "
                                   "ones wait) or Abort (end them at once with finish_reason abort and the tokens so "
                                   "far, for a trainer to resubmit).", enum=list(PAUSE_MODES), default="Keep"),
            "suspendKeepKV": {"type": "boolean", "default": False, "description": (
                "Whether every SUSPEND the lifecycle walk sends keeps the KV of the requests in flight in host "
                "memory: resuming copies it back and they continue without recomputing it (engines' --kv-on-refit "
                "decides after a refit in between).")},
            "drainTimeoutSeconds": int_field("How long engines may drain on shutdown, scale-down or deletion, and how "
                                             "long a PAUSE with pauseMode Wait lets running requests finish.",
                                             minimum=0, maximum=3600, default=60),
            "disruptionBudget": crd_rollout.disruption_budget_schema(),
            "rollout": crd_rollout.rollout_schema(),
        },
        required=["model"],
    )
    spec["x-kubernetes-validations"] = _rules_for("spec")
    return spec


def status_schema() -> dict[str, Any]:
    condition = obj_field(
        "A standard condition.",
        {
            "type": str_field("Condition type.", enum=list(CONDITION_TYPES)),
            "status": str_field("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": str_field("Machine-readable reason."),
            "message": str_field("Human-readable message."),
            "lastTransitionTime": str_field("When the status last changed.", format="date-time"),
            "observedGeneration": {"type": "integer", "format": "int64",
                                   "description": "Generation the condition was computed for."},
        },
        required=["type", "status"],
    )
    return obj_field(
        "Observed state, written by the operator.",
        {
            "phase": str_field("Summary phase.", enum=list(PHASES)),
            "lifecycle": obj_field("Lifecycle as requested and as acknowledged by the coordinator.", {
                "desired": str_field("spec.lifecycle as last seen.", enum=list(LIFECYCLES)),
                "observed": str_field("Lifecycle acknowledged by the coordinator.", enum=list(LIFECYCLES)),
                "since": str_field("When observed last changed.", format="date-time"),
                "message": str_field("Last acknowledgement or error."),
            }),
            "engines": obj_field("Engine groups.", {
                "desired": int_field("Engine groups wanted now (0 when Shutdown).", minimum=0),
                "ready": int_field("Engine groups whose pods are all ready.", minimum=0),
                "connected": int_field("Engine groups registered with the coordinator.", minimum=0),
            }),
            "model": obj_field("The weights being served.", {
                "path": str_field("spec.model.path of the weights the engines serve."),
                "revision": str_field("spec.model.revision of those weights."),
                "hub": str_field("spec.model.hub the weights were fetched from (absent: none)."),
                "epoch": {"type": "integer", "format": "int64", "minimum": 0,
                          "description": "Weights generation set by the last in-place refit (0: as started)."},
                "refittedAt": str_field("When the last in-place refit was acknowledged.", format="date-time"),
                "templatePath": str_field("Model path in the pod templates: engines that start load it, then the "
                                          "coordinator's current weights. Changes only when pods must roll."),
                "templateHub": str_field("spec.model.hub the pod templates fetch into templatePath (absent: none)."),
            }),
            "groups": crd_layout.groups_status_schema(),
            "roles": crd_disaggregation.roles_status_schema(),
            "kvEvents": crd_kv_tiers.events_status_schema(),
            "endpoint": str_field("OpenAI base URL inside the cluster."),
            "selector": str_field("Label selector of engine pods (for the scale subresource)."),
            "observedGeneration": {"type": "integer", "format": "int64",
                                   "description": "metadata.generation the status reflects."},
            "conditions": {"type": "array", "description": "Ready, CoordinatorReady, EnginesReady, "
                                                           "LifecycleSynced, SpecValid.",
                           "items": condition,
                           "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        },
    )


def openapi_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "A served LLM: coordinator, OpenAI server and data-parallel engine groups.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "x-kubernetes-validations": _rules_for(""),
    }


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "megatron-operator", "app.kubernetes.io/part-of": "megatron-serve"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["megatron"],
            },
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema()},
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.parallelism.data",
                        "statusReplicasPath": ".status.engines.ready",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "additionalPrinterColumns": [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Lifecycle", "type": "string", "jsonPath": ".status.lifecycle.observed",
                     "description": "Lifecycle acknowledged by the coordinator"},
                    {"name": "Ready Engines", "type": "integer", "jsonPath": ".status.engines.ready",
                     "description": "Ready engine groups"},
                    {"name": "Desired", "type": "integer", "jsonPath": ".spec.parallelism.data",
                     "description": "Engine groups (data parallelism)", "priority": 1},
                    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            }],
        },
    }


def crd_yaml() -> str:
    import yaml

    header = ("# Generated from megatron_operator/crd.py by `python -m megatron_operator.crd`; do not edit.\n"
              "# The chart's crds/ folder holds an identical copy (tests/operator keep them equal).\n")
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    text = crd_yaml()
    if argv:
        for path in argv:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
