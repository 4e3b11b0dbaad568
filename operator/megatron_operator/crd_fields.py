"""Builders of the CRD's OpenAPI fields, for :mod:`.crd` and its field groups (the ``crd_*`` modules).

Part of the CRD of :mod:`megatron_operator.crd`; it imports nothing of the operator, so that every ``crd_*``
module may use it. Each builder puts ``type`` and ``description`` first, as the generated YAML shows them.
"""

from __future__ import annotations

from typing import Any


def str_field(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def int_field(description: str, **extra: Any) -> dict[str, Any]:
    """An int32 (what the API server stores for integers unless told otherwise)."""
    return {"type": "integer", "format": "int32", "description": description, **extra}


def obj_field(description: str, properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "description": description, "properties": properties, **extra}


def secret_key_field(description: str) -> dict[str, Any]:
    """A key of a Secret (``{name, key}``): where the operator has a pod read an API key or a Hub token from."""
    return obj_field(description, {"name": str_field("Secret name.", minLength=1, maxLength=253),
                                   "key": str_field("Key in the Secret.", minLength=1, maxLength=253)},
                     required=["name", "key"])


def free_field(description: str) -> dict[str, Any]:
    """An object whose content the API server keeps as is (a Kubernetes type we pass through)."""
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


def volume_field(description: str) -> dict[str, Any]:
    """A Kubernetes volume source, ``{<kind>: {...}}``: a map of objects kept as they are. A map, not a free object,
    so that CEL rules may count its keys (``size()`` has no overload for an object of unknown fields, and the API
    server refuses a CRD whose rule calls it there)."""
    return {"type": "object", "description": description,
            "additionalProperties": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}
