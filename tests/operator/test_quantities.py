"""Quantities compared by value (:mod:`megatron_operator.quantities`): a live workload whose quantities the API
server rewrote into their canonical form still holds the rendered one, so a pass writes nothing."""

from __future__ import annotations

from megatron_operator import reconcile
from megatron_operator.quantities import equal


def test_quantities_are_equal_by_value_in_any_spelling():
    assert equal("0.5", "500m") and equal("1000m", "1") and equal("2048Mi", "2Gi") and equal(8, "8")
    assert not equal("1", "2") and not equal("fast", "fast") and not equal(True, "1")


def test_a_workload_the_server_canonicalized_needs_no_patch():
    rendered = {"spec": {"template": {"spec": {
        "containers": [{"name": "engine", "resources": {"requests": {"cpu": "0.5", "memory": "1.5Gi"},
                                                        "limits": {"memory": "2048Mi", "nvidia.com/gpu": 1}}}],
        "volumes": [{"name": "kv", "emptyDir": {"sizeLimit": "1024Mi"}}]}}}}
    live = {"spec": {"template": {"spec": {
        "containers": [{"name": "engine", "resources": {"requests": {"cpu": "500m", "memory": "1536Mi"},
                                                        "limits": {"memory": "2Gi", "nvidia.com/gpu": "1"}}}],
        "volumes": [{"name": "kv", "emptyDir": {"sizeLimit": "1Gi"}}]}}}}
    assert reconcile.diff(rendered, live) == {}
    # a real change is still one: more memory, or the same text under another key
    more = {"spec": {"template": {"spec": {"containers": [{"name": "engine", "resources": {
        "requests": {"cpu": "0.5", "memory": "2Gi"}}}]}}}}
    assert reconcile.diff(more, live) != {}
    env = {"env": [{"name": "CPU", "value": "0.5"}]}
    assert reconcile.diff(env, {"env": [{"name": "CPU", "value": "500m"}]}) != {}
