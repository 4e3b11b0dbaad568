"""Tenants in the resource (``spec.tenants``, ``spec.server.tenantHeader``, ``spec.server.shedding``): their schema,
and how they reach the server (docs/tenants.md).

Part of the CRD of :mod:`megatron_operator.crd` (which imports this module, never the reverse). The server reads
its tenants from its key file's document (``megatron_serve.server.tenants``); the operator renders that document
into the server container's ``$MEGATRON_SERVE_API_KEY`` (:func:`server_tenancy`), naming each key by a variable
(``key_env``) that Kubernetes fills from the key's Secret: the document holds no key, and a Secret's key never
lands in a pod template. ``spec.server.apiKeySecretRef``, when set beside tenants, is one more key, of no tenant
(the fairness header names its requests' tenants, else ``default``).
"""

from __future__ import annotations

import json
from typing import Any

from .crd_fields import secret_key_field

#: megatron_serve.wire.tenancy.CLASSES (a test keeps them equal).
CLASSES = ["critical", "standard", "sheddable"]
#: The variable of the server container that holds the key document (megatron_serve.server.API_KEY_ENV).
API_KEY_ENV = "MEGATRON_SERVE_API_KEY"
KEY_ENV_PREFIX = "MEGATRON_SERVE_TENANT_KEY_"
DEFAULT_KEY_ENV = "MEGATRON_SERVE_DEFAULT_KEY"

_LIMIT = {"type": "integer", "format": "int64", "minimum": 1}


def tenants_schema() -> dict[str, Any]:
    """``spec.tenants``: each tenant's name, class, weight, limits and keys."""
    tenant = {"type": "object", "description": "One tenant.", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$",
                 "description": "The tenant's name, in its series' tenant label; 'default' is the anonymous "
                                "tenant's, whose settings also go to tenants a fairness header names with none of "
                                "their own."},
        "class": {"type": "string", "enum": list(CLASSES), "default": "standard",
                  "description": "critical, standard or sheddable: strict bands; a better one preempts a worse one "
                                 "when slots or KV blocks run out; sheddable requests get 503 when the fleet is "
                                 "saturated."},
        "weight": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "default": 1,
                   "description": "The tenant's share of the tokens against the other tenants of its class."},
        "tokensPerMinute": {**_LIMIT, "description": "Prompt tokens plus max_tokens a minute (the unused part of "
                                                     "max_tokens comes back); over it, 429 with Retry-After."},
        "requestsPerMinute": {**_LIMIT, "description": "Requests a minute; over it, 429 with Retry-After."},
        "maxConcurrent": {**_LIMIT, "format": "int32", "description": "Requests at once; over it, 429."},
        "apiKeySecretRefs": {"type": "array", "maxItems": 64, "items": secret_key_field("A key in a Secret."),
                             "description": "The tenant's API keys, each a key in a Secret (none: a tenant the "
                                            "fairness header names)."},
    }}
    # a list keyed by name: the API server itself refuses two tenants of one name (a CEL rule comparing every pair
    # of 1024 tenants is over its cost budget)
    return {"type": "array", "maxItems": 1024, "items": tenant,
            "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
            "description": "Tenants of the fleet (docs/tenants.md): who a request belongs to (its API key, or the "
                           "fairness id a gateway sets), its class, its share and its limits. Changing them "
                           "restarts the server. Absent: no tenants, one key (apiKeySecretRef) or none."}


def server_fields() -> dict[str, dict[str, Any]]:
    """``spec.server``'s tenancy fields (absent: the server's defaults, and pod templates as they were)."""
    return {
        "tenantHeader": {"type": "string", "maxLength": 256,
                         "description": "The header that names a request's tenant when its key names none "
                                        "(--tenant-header; default: x-gateway-inference-fairness-id, read when "
                                        "spec.tenants is set)."},
        "shedding": {"type": "object", "description": "When sheddable requests get 503 with Retry-After: every "
                                                      "engine at queueDepth waiting requests or kvCacheUsage of its "
                                                      "KV blocks, or the fleet's status older than staleAfterSeconds "
                                                      "(the server's --shed-* flags).", "properties": {
            "queueDepth": {"type": "number", "exclusiveMinimum": True, "minimum": 0},
            "kvCacheUsage": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1},
            "staleAfterSeconds": {"type": "number", "exclusiveMinimum": True, "minimum": 0},
            "retryAfterSeconds": {"type": "integer", "format": "int32", "minimum": 1, "maximum": 3600}}},
    }


def server_tenancy(tenants: list[dict[str, Any]], api_key_ref: dict[str, str] | None,
                   server: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The server container's variables and flags for ``spec.tenants`` (none given: none); the key document in
    ``$MEGATRON_SERVE_API_KEY`` (module docstring), deterministic."""
    args = _flags(server)
    if not tenants:
        return [], args
    env: list[dict[str, Any]] = []
    keys: list[dict[str, str]] = []
    settings: dict[str, dict[str, Any]] = {}
    for tenant in tenants:
        settings[tenant["name"]] = {"class": tenant.get("class", "standard"), "weight": tenant.get("weight", 1),
                                    **{snake: tenant[camel] for camel, snake in _LIMITS.items() if camel in tenant}}
        for ref in tenant.get("apiKeySecretRefs", []):
            name = f"{KEY_ENV_PREFIX}{len(keys)}"
            env.append(_from_secret(name, ref))
            keys.append({"key_env": name, "tenant": tenant["name"]})
    if api_key_ref:
        env.append(_from_secret(DEFAULT_KEY_ENV, api_key_ref))
        keys.append({"key_env": DEFAULT_KEY_ENV})
    document = json.dumps({"tenants": settings, "keys": keys}, sort_keys=True, separators=(",", ":"))
    return [*env, {"name": API_KEY_ENV, "value": document}], args


_LIMITS = {"tokensPerMinute": "tokens_per_minute", "requestsPerMinute": "requests_per_minute",
           "maxConcurrent": "max_concurrent"}
_SHEDDING = {"queueDepth": "--shed-queue-depth", "kvCacheUsage": "--shed-kv-cache-usage",
             "staleAfterSeconds": "--shed-stale-after", "retryAfterSeconds": "--shed-retry-after"}


def _flags(server: dict[str, Any]) -> list[str]:
    args = ["--tenant-header", server["tenantHeader"]] if "tenantHeader" in server else []
    for field, flag in _SHEDDING.items():
        if field in server.get("shedding", {}):
            args += [flag, str(server["shedding"][field])]
    return args


def _from_secret(name: str, ref: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}}
