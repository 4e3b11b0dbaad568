"""The schema of prefill/decode disaggregation (``spec.engine.disaggregation``) and of the groups' roles.

Part of the CRD of :mod:`megatron_operator.crd` (which imports this module, never the reverse).

The engine groups of a disaggregated resource are the runtime's ``run --prefill-engines N
--decode-engines M`` (docs/kv-tiers.md): groups ``0 .. N-1`` prefill (vLLM's ``kv_role``
``kv_producer``), groups ``N .. N+M-1`` decode (``kv_consumer``), each engine told its role by
``--kv-transfer-config``. ``spec.parallelism.data`` stays the number of groups, so it must be
``N + M``. A group of several ranks (tensor, pipeline) hands its blocks on as one engine does; with data-parallel
attention the engine refuses a role, and so does the CRD.
"""

from __future__ import annotations

from typing import Any

from .crd_fields import int_field, obj_field
from .crd_rules import CelCheck

MAX_REPLICAS = 256
#: A group's role in the status -> the engine's ``kv_role`` (vLLM's names; megatron_serve.fleet.argv.KV_ROLES).
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def _replicas(description: str) -> dict[str, Any]:
    return int_field(description, minimum=1, maximum=MAX_REPLICAS)


def disaggregation_schema() -> dict[str, Any]:
    """``spec.engine.disaggregation`` (its CEL rules are added by :mod:`.crd` from :data:`CEL_RULES`)."""
    return obj_field(
        "Prefill/decode disaggregation (docs/kv-tiers.md): the first prefillReplicas engine groups "
        "compute prompts and first tokens, the next decodeReplicas groups continue from the KV "
        "blocks the coordinator hands them (--kv-transfer-config with kv_role kv_producer or "
        "kv_consumer). spec.parallelism.data must be their sum, and each group one rank (tensor "
        "and pipeline 1). Absent: every engine does both. Changing it rolls the engine pods.",
        {
            "prefillReplicas": _replicas("Prefill engine groups (run --prefill-engines)."),
            "decodeReplicas": _replicas("Decode engine groups (run --decode-engines)."),
        },
        required=["prefillReplicas", "decodeReplicas"],
    )


def roles_status_schema() -> dict[str, Any]:
    """``status.roles``: each engine group's part (written for resources with engine.disaggregation)."""
    role = obj_field(
        "One engine group's part.",
        {
            "group": {"type": "integer", "format": "int32", "minimum": 0, "description": "Engine group id."},
            "role": {"type": "string", "enum": list(KV_ROLES), "description": "prefill or decode."},
            "kvRole": {"type": "string", "enum": list(KV_ROLES.values()),
                       "description": "The kv_role of the group's --kv-transfer-config."},
            "ready": {"type": "boolean", "description": "The group's pods are all ready."},
        },
        required=["group", "role"],
    )
    return {"type": "array", "items": role,
            "description": "Disaggregated resources (spec.engine.disaggregation): each engine group's role."}


def role_of(group: int, prefill_replicas: int) -> str:
    """The role of engine group ``group``: prefill groups first, as ``run --prefill-engines`` numbers them."""
    return "prefill" if group < prefill_replicas else "decode"


def _sum_rule(spec: dict[str, Any]) -> bool:
    dis = spec.get("engine", {}).get("disaggregation")
    if dis is None:
        return True
    return int(spec.get("parallelism", {}).get("data", 1)) == int(dis["prefillReplicas"]) + int(dis["decodeReplicas"])


def _attention_ranks_rule(spec: dict[str, Any]) -> bool:
    engine = spec.get("engine", {})
    return "disaggregation" not in engine or int(engine.get("parallelism", {}).get("dataParallelAttention", 1)) == 1


# (schema path, CEL rule, message, python twin); see crd.CEL_RULES
CEL_RULES: list[tuple[str, str, str, CelCheck]] = [
    (
        "spec",
        "!has(self.engine.disaggregation) || self.parallelism.data == self.engine.disaggregation.prefillReplicas "
        "+ self.engine.disaggregation.decodeReplicas",
        "parallelism.data must equal engine.disaggregation.prefillReplicas + engine.disaggregation.decodeReplicas "
        "(the engine groups are the prefill and the decode engines)",
        _sum_rule,
    ),
    (
        "spec",
        "!has(self.engine.disaggregation) || !has(self.engine.parallelism) "
        "|| !has(self.engine.parallelism.dataParallelAttention) || self.engine.parallelism.dataParallelAttention == 1",
        "engine.disaggregation is not implemented with engine.parallelism.dataParallelAttention (the engine refuses "
        "a role with data-parallel attention)",
        _attention_ranks_rule,
    ),
]
