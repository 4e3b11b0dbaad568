"""The schema of an engine group's layout (``spec.engine.parallelism``) and of its ranks in the status.

Part of the CRD of :mod:`megatron_operator.crd` (which imports this module, never the reverse).

The fields follow the group, not the command line: ``tensor`` is the number of ranks (GPUs) of one
pipeline stage and ``dataParallelAttention`` splits them into attention ranks that each schedule their
own requests, so one group has ``tensor * pipeline`` ranks whatever the split (as ``spec.parallelism``
always counted). The engines get vLLM's flags: ``--tensor-parallel-size tensor / dataParallelAttention
--data-parallel-size dataParallelAttention --enable-expert-parallel``, where vLLM's ep = tp x dp is
``expert = tensor``: experts are either sliced over a stage's ranks (``expert: 1``) or placed whole on
every one of them. With ``dataParallelAttention`` each pod of a group is one attention rank's engine (it starts its
own ``tensor / dataParallelAttention`` ranks only), so an attention rank must fit a pod.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_serve.client.vllm_options import ALL2ALL_BACKENDS

from .crd_fields import int_field, obj_field

MAX_TENSOR = 64
MAX_PIPELINE = 16

CelCheck = Callable[[dict[str, Any]], bool]


def _size(description: str, maximum: int) -> dict[str, Any]:
    return int_field(description, minimum=1, maximum=maximum, default=1)


def parallelism_schema() -> dict[str, Any]:
    """``spec.engine.parallelism`` (its CEL rules are added by :mod:`.crd` from :data:`CEL_RULES`)."""
    return obj_field(
        "Layout of one engine group (docs/parallelism.md, On Kubernetes). Set, each group is rendered "
        "as one gang: a leader pod and worker pods (a LeaderWorkerSet where the cluster has its CRD, "
        "else a StatefulSet) that start together and restart together when one rank dies. Absent: "
        "spec.parallelism.tensor and .pipeline give the layout, as before. spec.parallelism.data stays "
        "the number of groups.",
        {
            "tensor": _size("Ranks (GPUs) of one pipeline stage. With dataParallelAttention, each attention rank "
                            "runs tensor / dataParallelAttention-way tensor parallelism (the engines' "
                            "--tensor-parallel-size).", MAX_TENSOR),
            "pipeline": _size("Pipeline stages of the group (--pipeline-parallel-size); the group has "
                              "tensor * pipeline ranks.", MAX_PIPELINE),
            "expert": _size("Expert-parallel ranks of a mixture-of-experts model: 1 slices every expert over the "
                            "stage's tensor ranks; tensor places whole experts on each of them and moves tokens with "
                            "all-to-all (--enable-expert-parallel; vLLM's ep = tp x dp).", MAX_TENSOR),
            "all2allBackend": {"type": "string", "enum": list(ALL2ALL_BACKENDS), "default": "auto",
                               "description": "How expert-parallel MoE layers move tokens (the engines' "
                                              "--all2all-backend): auto takes DeepEP where every rank of the group "
                                              "can run it, else all-to-all."},
            "dataParallelAttention": _size("Attention ranks per stage that each schedule their own requests and "
                                           "share the MoE layers (--data-parallel-size with "
                                           "--enable-expert-parallel); must divide tensor and needs expert = tensor.",
                                           MAX_TENSOR),
        },
    )


def groups_status_schema() -> dict[str, Any]:
    """``status.groups``: each gang's ranks, one entry per pod (written for resources with engine.parallelism)."""
    rank = obj_field(
        "One pod of the group.",
        {
            "rank": {"type": "integer", "format": "int32", "minimum": 0,
                     "description": "The pod's node rank: 0 is the leader (the group's rank 0, which talks to the "
                                    "coordinator)."},
            "firstRank": {"type": "integer", "format": "int32", "minimum": 0,
                          "description": "Global rank of the pod's first process (node rank * GPUs per pod)."},
            "pod": {"type": "string", "description": "Pod name."},
            "podUID": {"type": "string", "description": "Pod uid: a new uid is a recreated pod."},
            "ready": {"type": "boolean", "description": "The pod is ready."},
            "restarts": {"type": "integer", "format": "int32", "minimum": 0,
                         "description": "Restarts of the pod's engine container."},
            "nodeName": {"type": "string", "description": "Node the pod runs on."},
        },
        required=["rank", "pod"],
    )
    group = obj_field(
        "One engine group (gang).",
        {
            "group": {"type": "integer", "format": "int32", "minimum": 0, "description": "Engine group id."},
            "workload": {"type": "string", "enum": ["LeaderWorkerSet", "StatefulSet"],
                         "description": "Kind of the group's workload."},
            "ready": {"type": "boolean", "description": "Every rank's pod is ready."},
            "ranks": {"type": "array", "items": rank, "description": "The group's pods, by node rank."},
            "startedWith": {
                "type": "array",
                "description": "StatefulSet groups: the pods the group last ran with, complete. When some of them "
                               "are recreated or restarted and others are not, the operator deletes the others so "
                               "that every rank starts again together.",
                "items": {"type": "object", "required": ["rank"], "properties": {
                    "rank": {"type": "integer", "format": "int32", "minimum": 0, "description": "Node rank."},
                    "podUID": {"type": "string", "description": "Pod uid."},
                    "restarts": {"type": "integer", "format": "int32", "minimum": 0,
                                 "description": "Restarts of its engine container."},
                }},
            },
        },
        required=["group"],
    )
    return {"type": "array", "items": group,
            "description": "Engine groups rendered as gangs (spec.engine.parallelism): each pod of each group."}


def _layout(spec: dict[str, Any]) -> tuple[int, int]:
    par = spec.get("engine", {}).get("parallelism", {})
    return int(par.get("tensor", 1)), int(par.get("pipeline", 1))


def _gpus_rule(spec: dict[str, Any]) -> bool:
    if "parallelism" not in spec.get("engine", {}):
        return True
    tensor, pipeline = _layout(spec)
    ranks, gpus = tensor * pipeline, int(spec["engine"].get("gpusPerPod", 8))
    return ranks % gpus == 0 or gpus % ranks == 0


def _attention_rank_fits_a_pod_rule(spec: dict[str, Any]) -> bool:
    par = spec.get("engine", {}).get("parallelism")
    if par is None or "dataParallelAttention" not in par:
        return True
    data = int(par["dataParallelAttention"])
    return data == 1 or int(par.get("tensor", 1)) // data <= int(spec["engine"].get("gpusPerPod", 8))


def _one_spelling_rule(spec: dict[str, Any]) -> bool:
    if "parallelism" not in spec.get("engine", {}):
        return True
    old = int(spec.get("parallelism", {}).get("tensor", 1))
    return old in (1, _layout(spec)[0])


# (schema path, CEL rule, message, python twin); see crd.CEL_RULES
CEL_RULES: list[tuple[str, str, str, CelCheck]] = [
    (
        "spec.engine.parallelism",
        "self.tensor % self.dataParallelAttention == 0",
        "engine.parallelism.dataParallelAttention must divide engine.parallelism.tensor (each attention rank runs "
        "tensor / dataParallelAttention-way tensor parallelism)",
        lambda par: int(par.get("tensor", 1)) % int(par.get("dataParallelAttention", 1)) == 0,
    ),
    (
        "spec.engine.parallelism",
        "self.expert == 1 || self.expert == self.tensor",
        "engine.parallelism.expert must be 1 (experts sliced over the tensor ranks) or equal to "
        "engine.parallelism.tensor (whole experts on every rank of a stage: ep = tp x dp)",
        lambda par: int(par.get("expert", 1)) in (1, int(par.get("tensor", 1))),
    ),
    (
        "spec.engine.parallelism",
        "self.dataParallelAttention == 1 || self.expert > 1",
        "engine.parallelism.dataParallelAttention needs expert parallelism (expert = tensor): the attention ranks "
        "share the MoE layers through it; replicas of a dense model are spec.parallelism.data",
        lambda par: int(par.get("dataParallelAttention", 1)) == 1 or int(par.get("expert", 1)) > 1,
    ),
    (
        "spec",
        "!has(self.engine.parallelism) || (self.engine.parallelism.tensor * self.engine.parallelism.pipeline) "
        "% self.engine.gpusPerPod == 0 || self.engine.gpusPerPod % (self.engine.parallelism.tensor * "
        "self.engine.parallelism.pipeline) == 0",
        "engine.parallelism.tensor * engine.parallelism.pipeline must be a multiple or a divisor of engine.gpusPerPod "
        "(a group fills whole pods, or one pod holds it)",
        _gpus_rule,
    ),
    (
        "spec.engine.parallelism",
        "self.dataParallelAttention == 1 || self.pipeline == 1",
        "engine.parallelism.dataParallelAttention does not serve pipeline stages yet (engine.parallelism.pipeline "
        "must be 1 with it)",
        lambda par: int(par.get("dataParallelAttention", 1)) == 1 or int(par.get("pipeline", 1)) == 1,
    ),
    (
        "spec",
        "!has(self.engine.parallelism) || !has(self.engine.parallelism.dataParallelAttention) "
        "|| self.engine.parallelism.dataParallelAttention == 1 "
        "|| self.engine.parallelism.tensor / self.engine.parallelism.dataParallelAttention <= self.engine.gpusPerPod",
        "engine.parallelism.tensor / engine.parallelism.dataParallelAttention must be at most engine.gpusPerPod "
        "(each pod runs one attention rank's engine, which starts its own tensor-parallel ranks)",
        _attention_rank_fits_a_pod_rule,
    ),
    (
        "spec",
        "!has(self.engine.parallelism) || self.parallelism.tensor == 1 "
        "|| self.parallelism.tensor == self.engine.parallelism.tensor",
        "parallelism.tensor is the older spelling of engine.parallelism.tensor: leave it out (or equal) when "
        "engine.parallelism is set",
        _one_spelling_rule,
    ),
]
