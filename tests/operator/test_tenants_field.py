"""``spec.tenants`` and the server's tenancy fields (docs/tenants.md): rendered into the server container as the key
document the server itself reads (keys by variable, each from its Secret; no key in the pod template) and its
flags (parsed back by the server's own parser), the OpenAI port still counted as keyed, duplicate names refused
by the operator and by the CRD, and a resource without tenants rendered as before."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from megatron_operator import crd_tenants, network, spec
from megatron_operator.render import render
from megatron_serve.server.tenants import parse_document
from megatron_serve.wire.tenancy import CLASSES

from .helpers import ROOT, load_yaml
from .test_operator_crd import crd_errors
from .test_operator_render import CONFIG, _containers, _parser_for, by_key, identified

pytestmark = pytest.mark.timeout(120)

TENANTS = [
    {"name": "chat", "class": "critical", "weight": 3, "requestsPerMinute": 600,
     "apiKeySecretRefs": [{"name": "chat-keys", "key": "a"}, {"name": "chat-keys", "key": "b"}]},
    {"name": "batch", "class": "sheddable", "tokensPerMinute": 200000, "maxConcurrent": 8,
     "apiKeySecretRefs": [{"name": "batch-key", "key": "key"}]},
    {"name": "default"},
]


def example(tenants: list[dict[str, Any]] | None = None, **server: Any) -> dict[str, Any]:
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "single-gpu.yaml")
    if tenants is not None:
        resource["spec"]["tenants"] = copy.deepcopy(tenants)
    resource["spec"].setdefault("server", {}).update(server)
    return resource


def server_container(resource: dict[str, Any]) -> dict[str, Any]:
    objects = by_key(render(identified(resource), CONFIG))
    (server,) = [c for c in _containers(objects[("Deployment", "llama-1b-coordinator")]) if c["name"] == "server"]
    return server


def test_tenants_reach_the_server_as_its_key_document_with_keys_from_their_secrets():
    resource = example(TENANTS, apiKeySecretRef={"name": "gateway", "key": "key"}, tenantHeader="x-team",
                       shedding={"queueDepth": 4, "kvCacheUsage": 0.9, "retryAfterSeconds": 2})
    assert crd_errors(resource) == []
    server = server_container(resource)
    env = {e["name"]: e for e in server["env"]}
    refs = {name: e["valueFrom"]["secretKeyRef"] for name, e in env.items() if "valueFrom" in e and "TENANT" in name}
    assert refs == {"MEGATRON_SERVE_TENANT_KEY_0": {"name": "chat-keys", "key": "a"},
                    "MEGATRON_SERVE_TENANT_KEY_1": {"name": "chat-keys", "key": "b"},
                    "MEGATRON_SERVE_TENANT_KEY_2": {"name": "batch-key", "key": "key"}}
    assert env["MEGATRON_SERVE_DEFAULT_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "gateway", "key": "key"}
    document = env["MEGATRON_SERVE_API_KEY"]["value"]
    values = {"MEGATRON_SERVE_TENANT_KEY_0": "ka", "MEGATRON_SERVE_TENANT_KEY_1": "kb",
              "MEGATRON_SERVE_TENANT_KEY_2": "kbatch", "MEGATRON_SERVE_DEFAULT_KEY": "kgw"}
    table = parse_document(document, values)  # the server's own reading of it
    chat = table.tenant(table.entry(b"kb"), None)
    assert (chat.name, chat.priority_class, chat.weight, chat.limits.requests_per_minute) == ("chat", "critical", 3, 600)
    batch = table.tenant(table.entry(b"kbatch"), None)
    assert (batch.priority_class, batch.limits.tokens_per_minute, batch.limits.max_concurrent) == ("sheddable",
                                                                                                    200000, 8)
    assert table.tenant(table.entry(b"kgw"), "user-1").name == "user-1" and table.entry(b"ka") is not None
    assert "ka" not in json.dumps(server)  # no key in the pod template
    parsed, unknown = _parser_for("server").parse_known_args(server["args"][1:])
    assert unknown == [] and parsed.tenant_header == "x-team"
    assert (parsed.shed_queue_depth, parsed.shed_kv_cache_usage, parsed.shed_retry_after) == (4.0, 0.9, 2)
    assert parsed.shed_stale_after is None
    http = {"name": "http"}
    assert network._authenticated(server, http)  # the OpenAI port asks for a key: the document lists some
    open_server = example([{"name": "default"}])
    del open_server["spec"]["server"]["apiKeySecretRef"]
    assert not network._authenticated(server_container(open_server), http)  # no key at all: keys [] (open)


def test_without_tenants_the_server_is_rendered_as_before():
    plain, keyed = server_container(example()), server_container(example(apiKeySecretRef={"name": "k", "key": "k"}))
    assert not any("TENANT" in e["name"] for e in plain["env"] + keyed["env"])
    assert [e for e in keyed["env"] if e["name"] == "MEGATRON_SERVE_API_KEY"][0]["valueFrom"]["secretKeyRef"] == {
        "name": "k", "key": "k"}
    assert "--tenant-header" not in plain["args"] and not any(a.startswith("--shed") for a in plain["args"])


def test_duplicate_tenant_names_and_bad_classes_are_refused_naming_the_field():
    twice = example([{"name": "a"}, {"name": "a", "class": "critical"}])
    assert any(e.startswith("spec.tenants[1]: Duplicate value") for e in crd_errors(twice))
    with pytest.raises(spec.SpecError) as refused:
        spec.parse(twice)
    assert "spec.tenants[1]: duplicate value (name 'a'): each item's name must be unique" in str(refused.value)
    assert crd_errors(example([{"name": "a", "class": "urgent"}])) != []
    assert crd_errors(example([{"name": "a", "weight": 0}])) != []


def test_the_classes_are_the_servers():
    assert crd_tenants.CLASSES == list(CLASSES)
