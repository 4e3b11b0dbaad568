"""``spec.engine.kvOffloadingSize`` and ``kvOnRefit``: the engines' ``--kv-offloading-size`` and ``--kv-on-refit``
(parsed back by the engine's own parser), the engine pods' memory raised by the host tier where the resource sets
it, bad values refused naming the field (by the operator and by the CRD), and the fields through the strict
API-server double: applied, rendered, and changed in place."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from megatron_operator import crd_kv_tiers, spec
from megatron_operator.render import render
from megatron_serve.wire.lifecycle import KV_ON_REFIT

from .helpers import ROOT, fake_coordinator_for, load_yaml, wait_for
from .test_operator_crd import assert_refused, crd_errors
from .test_operator_render import CONFIG, _containers, _parser_for, by_key, identified

pytestmark = pytest.mark.timeout(120)


def example(**engine: Any) -> dict[str, Any]:
    """The single-GPU example (memory request 32Gi, limit 48Gi) with ``engine`` fields added."""
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "single-gpu.yaml")
    resource["spec"]["engine"].update(engine)
    return resource


def engine_container(resource: dict[str, Any]) -> dict[str, Any]:
    (engine,) = _containers(by_key(render(identified(resource), CONFIG))[("StatefulSet", "llama-1b-engine-0")])
    return engine


def parsed_args(engine: dict[str, Any]):
    command, *args = engine["args"]
    parsed, unknown = _parser_for(command).parse_known_args(args)
    assert unknown == []
    return parsed


def test_the_fields_reach_the_engine_command_and_the_pod_memory():
    engine = engine_container(example(kvOffloadingSize=8, kvOnRefit="keep"))
    parsed = parsed_args(engine)
    assert (parsed.kv_offloading_size, parsed.kv_on_refit) == (8.0, "keep")
    assert engine["resources"]["requests"]["memory"] == "40Gi" and engine["resources"]["limits"]["memory"] == "56Gi"
    assert engine["resources"]["requests"]["cpu"] == "4"  # the rest as the resource gave it


def test_without_the_fields_the_pod_template_is_as_before():
    # the control: no flag and the memory as given, so that existing resources' StatefulSets do not roll
    engine = engine_container(example())
    assert "--kv-offloading-size" not in engine["args"] and "--kv-on-refit" not in engine["args"]
    assert (engine["resources"]["requests"]["memory"], engine["resources"]["limits"]["memory"]) == ("32Gi", "48Gi")
    parsed = parsed_args(engine)
    assert parsed.kv_offloading_size is None and parsed.kv_on_refit == "recompute"


@pytest.mark.parametrize("resources, gib, expected", [
    ({"requests": {"memory": "32Gi"}}, 0.5, {"requests": {"memory": "33280Mi"}}),
    ({"limits": {"memory": "1000M", "cpu": "2"}}, 1, {"limits": {"memory": "2073741824", "cpu": "2"}}),
    ({"requests": {"cpu": "4"}}, 8, {"requests": {"cpu": "4"}}),  # no memory set: none added
    ({}, 8, {}),
])
def test_memory_is_raised_where_it_is_set_in_kubernetes_quantities(resources, gib, expected):
    assert crd_kv_tiers.with_host_tier(resources, gib) == expected
    assert crd_kv_tiers.with_host_tier(resources, None) == resources


BAD = {
    "a zero size": ({"kvOffloadingSize": 0}, "spec.engine.kvOffloadingSize: must be greater than 0"),
    "a negative size": ({"kvOffloadingSize": -1}, "spec.engine.kvOffloadingSize: must be greater than 0"),
    "a size as a string": ({"kvOffloadingSize": "8Gi"}, "spec.engine.kvOffloadingSize: must be a number"),
    "a boolean size": ({"kvOffloadingSize": True}, "spec.engine.kvOffloadingSize: must be a number"),
    "an unknown policy": ({"kvOnRefit": "later"}, "spec.engine.kvOnRefit: unsupported value 'later'"),
    "a tier without prefix caching": ({"kvOffloadingSize": 8, "kvCache": {"prefixCaching": False}},
                                      "spec.engine: engine.kvOffloadingSize needs engine.kvCache.prefixCaching"),
}


def assert_engine_fields_refused(bad: dict[str, tuple[dict[str, Any], str]], case: str) -> None:
    """The example with ``bad[case]``'s engine fields is refused with its reason, by the parser and the CRD."""
    fields, reason = bad[case]
    assert_refused(example(**fields), reason, case)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_values_are_refused_naming_the_field(case):
    assert_engine_fields_refused(BAD, case)


@pytest.mark.parametrize("layout", [
    lambda s: s["parallelism"].update(tensor=2) or s["engine"].update(gpusPerPod=2),
    lambda s: s["engine"].update(parallelism={"pipeline": 2}, gpusPerPod=2),
    lambda s: s["engine"].update(parallelism={"tensor": 2, "expert": 2, "dataParallelAttention": 2}, gpusPerPod=2),
], ids=["tensor", "pipeline-gang", "data-parallel-attention"])
def test_a_host_tier_serves_a_group_of_several_ranks_and_a_disk_tier_is_refused(layout):
    resource = example(kvOffloadingSize=8)
    layout(resource["spec"])
    spec.parse(identified(resource))  # each rank keeps its part of every block in host memory (docs/kv-tiers.md)
    assert not crd_errors(resource)
    resource["spec"]["engine"]["kvDiskTier"] = {"size": 10}
    with pytest.raises(spec.SpecError) as info:
        spec.parse(identified(resource))
    assert any(r.startswith("spec: engine.kvDiskTier needs engine groups of one rank")
               for r in info.value.reasons), info.value.reasons
    assert crd_errors(resource)


def test_the_policies_are_the_engine_s():
    assert crd_kv_tiers.KV_ON_REFIT == list(KV_ON_REFIT)


def test_the_cel_rules_agree_with_their_python_twins():
    import celpy

    env = celpy.Environment()
    specs = [{"parallelism": {"tensor": t, "pipeline": 1, "data": 1},
              "engine": {"gpusPerPod": 8, "kvCache": {"prefixCaching": caching},
                         **({} if gang is None else {"parallelism": {"tensor": 1, "pipeline": gang}}),
                         **({} if size is None else {"kvOffloadingSize": size})}}
             for t in (1, 2) for gang in (None, 1, 2) for size in (None, 4.5) for caching in (True, False)]
    samples = {"spec": specs, "spec.engine": [s["engine"] for s in specs]}
    for where, rule, _, check in crd_kv_tiers.CEL_RULES:
        if "kvDiskTier" in rule or "kvEvents" in rule:
            continue  # sampled by tests/operator/test_kv_node.py
        program = env.program(env.compile(rule))
        for sample in samples[where]:
            assert bool(program.evaluate({"self": celpy.json_to_cel(sample)})) == check(sample), (rule, sample)
        assert {check(s) for s in samples[where]} == {True, False}  # the samples reach both verdicts


async def test_through_the_api_server_the_fields_render_and_a_change_rolls_the_engines(cluster):
    await cluster.install_crd()
    cluster.start_controllers()
    resource = copy.deepcopy(example(kvOffloadingSize=8))
    resource["metadata"]["namespace"] = "default"
    await cluster.apply(resource)
    await cluster.start_operator(fake_coordinator_for(cluster, "default", "llama-1b"))
    await wait_for(lambda: cluster.status("default", "llama-1b").get("phase") == "Ready", what="phase Ready")

    def engine() -> dict[str, Any]:
        (container,) = cluster.emu.find("statefulsets", "default", "llama-1b-engine-0")["spec"]["template"]["spec"][
            "containers"]
        return container

    assert parsed_args(engine()).kv_offloading_size == 8.0
    assert engine()["resources"]["limits"]["memory"] == "56Gi"
    await cluster.patch_mi("default", "llama-1b", {"spec": {"engine": {"kvOffloadingSize": 16, "kvOnRefit": "keep"}}})
    await wait_for(lambda: engine()["resources"]["limits"]["memory"] == "64Gi", what="the engines rolled")
    parsed = parsed_args(engine())
    assert (parsed.kv_offloading_size, parsed.kv_on_refit) == (16.0, "keep")
