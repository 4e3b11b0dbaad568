"""``spec.engine.disaggregation``: prefill groups first, then decode groups, each engine told its ``kv_role`` by
``--kv-transfer-config`` as ``run --prefill-engines`` tells it; refused (naming the field) where the engine would
refuse it; each group's role in ``status.roles``, through the strict API-server double."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from megatron_operator import spec
from megatron_operator.render import render
from megatron_serve.fleet.argv import kv_transfer_config

from .helpers import ROOT, fake_coordinator_for, load_yaml, wait_for
from .test_operator_crd import assert_refused, crd_errors
from .test_operator_render import CONFIG, _containers, _parser_for, by_key, identified

pytestmark = pytest.mark.timeout(120)

EXAMPLE = ROOT / "manifests" / "examples" / "prefill-decode.yaml"


def example() -> dict[str, Any]:
    (resource,) = load_yaml(EXAMPLE)
    return resource


def kv_roles(resource: dict[str, Any]) -> dict[str, str | None]:
    """Each engine StatefulSet's kv_role, as the runtime's own parser reads its container's arguments."""
    roles = {}
    for (kind, name), obj in sorted(by_key(render(identified(resource), CONFIG)).items()):
        if kind != "StatefulSet":
            continue
        (engine,) = _containers(obj)
        command, *args = engine["args"]
        parsed, unknown = _parser_for(command).parse_known_args(args)
        assert unknown == []
        roles[name] = None if parsed.kv_transfer_config is None else kv_transfer_config(parsed.kv_transfer_config)
    return roles


def test_prefill_groups_come_first_and_carry_the_producer_role():
    assert kv_roles(example()) == {"llama-8b-pd-engine-0": "kv_producer", "llama-8b-pd-engine-1": "kv_consumer",
                                   "llama-8b-pd-engine-2": "kv_consumer"}
    parsed = spec.parse(identified(example()))
    assert [parsed.role(g) for g in range(parsed.data)] == ["prefill", "decode", "decode"]


def test_without_the_field_no_engine_gets_a_role():
    # the control: a colocated resource's pod templates carry no --kv-transfer-config (they do not roll)
    resource = example()
    del resource["spec"]["engine"]["disaggregation"]
    assert set(kv_roles(resource).values()) == {None}
    assert spec.parse(identified(resource)).role(0) is None


def test_the_flag_is_the_runtime_s_own_spelling():
    (engine,) = _containers(by_key(render(identified(example()), CONFIG))[("StatefulSet", "llama-8b-pd-engine-0")])
    value = engine["args"][engine["args"].index("--kv-transfer-config") + 1]
    assert json.loads(value) == {"kv_connector": "CoordinatorConnector", "kv_role": "kv_producer"}


BAD = {
    "counts not summing to data": (
        lambda s: s["parallelism"].update(data=4),
        "spec: parallelism.data must equal engine.disaggregation.prefillReplicas + "
        "engine.disaggregation.decodeReplicas"),
    "data-parallel attention": (
        lambda s: s["engine"].update(parallelism={"tensor": 2, "expert": 2, "dataParallelAttention": 2}, gpusPerPod=2),
        "spec: engine.disaggregation is not implemented with engine.parallelism.dataParallelAttention"),
    "no decode engine": (
        lambda s: s["engine"]["disaggregation"].update(decodeReplicas=0) or s["parallelism"].update(data=1),
        "spec.engine.disaggregation.decodeReplicas: must be at least 1, got 0"),
    "decode count missing": (
        lambda s: s["engine"]["disaggregation"].pop("decodeReplicas"),
        "spec.engine.disaggregation.decodeReplicas: required field is missing"),
    "an unknown key": (
        lambda s: s["engine"]["disaggregation"].update(prefill=1),
        "spec.engine.disaggregation.prefill: unknown field"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_disaggregation_is_refused_naming_the_field(case):
    mutate, reason = BAD[case]
    resource = example()
    mutate(resource["spec"])
    assert_refused(resource, reason, case)


@pytest.mark.parametrize("layout", [
    lambda s: s["parallelism"].update(tensor=2) or s["engine"].update(gpusPerPod=2),
    lambda s: s["engine"].update(parallelism={"pipeline": 2}, gpusPerPod=1),
], ids=["tensor", "pipeline-gang"])
def test_groups_of_several_ranks_take_roles(layout):
    """Each rank hands its part of a prefilled request's blocks on (docs/kv-tiers.md): every pod of a group gets its
    group's role."""
    resource = example()
    layout(resource["spec"])
    assert not crd_errors(resource)
    rendered = render(identified(resource), CONFIG)
    roles = {}
    for (kind, name), manifest in by_key(rendered).items():
        if name.startswith("llama-8b-pd-engine-") and kind in ("StatefulSet", "LeaderWorkerSet"):
            for container in _containers(manifest):
                args = container["args"]
                roles.setdefault(name, set()).add(json.loads(args[args.index("--kv-transfer-config") + 1])["kv_role"])
    assert roles == {"llama-8b-pd-engine-0": {"kv_producer"}, "llama-8b-pd-engine-1": {"kv_consumer"},
                     "llama-8b-pd-engine-2": {"kv_consumer"}}, roles


def test_the_cel_rules_agree_with_their_python_twins():
    import celpy

    from megatron_operator import crd_disaggregation

    env = celpy.Environment()
    samples = [{"parallelism": {"tensor": t, "pipeline": 1, "data": data},
                "engine": {"gpusPerPod": 8, **({} if gang is None else {"parallelism": {"tensor": 1, "pipeline": gang,
                                                                                          **attention}}),
                           **({} if pd is None else {"disaggregation": {"prefillReplicas": pd[0],
                                                                        "decodeReplicas": pd[1]}})}}
               for t in (1, 2) for data in (1, 2, 3) for gang in (None, 1, 2) for pd in (None, (1, 1), (1, 2))
               for attention in ({}, {"dataParallelAttention": 1}, {"dataParallelAttention": 2})]
    for _, rule, _, check in crd_disaggregation.CEL_RULES:
        program = env.program(env.compile(rule))
        verdicts = {bool(program.evaluate({"self": celpy.json_to_cel(s)})) == check(s) for s in samples}
        assert verdicts == {True}, rule
        assert {check(s) for s in samples} == {True, False}  # the samples reach both verdicts


async def test_the_status_shows_each_group_s_role(cluster):
    await cluster.install_crd()
    cluster.start_controllers()
    resource = copy.deepcopy(example())
    resource["metadata"]["namespace"] = "default"
    await cluster.apply(resource)
    await cluster.start_operator(fake_coordinator_for(cluster, "default", "llama-8b-pd"))
    st = await wait_for(lambda: (s := cluster.status("default", "llama-8b-pd")).get("phase") == "Ready" and s,
                        what="phase Ready")
    assert st["roles"] == [{"group": 0, "role": "prefill", "kvRole": "kv_producer", "ready": True},
                           {"group": 1, "role": "decode", "kvRole": "kv_consumer", "ready": True},
                           {"group": 2, "role": "decode", "kvRole": "kv_consumer", "ready": True}]
    # back to colocated engines: the roles leave the status
    await cluster.patch_mi("default", "llama-8b-pd", {"spec": {"engine": {"disaggregation": None}}})
    await wait_for(lambda: "roles" not in cluster.status("default", "llama-8b-pd")
                   and cluster.status("default", "llama-8b-pd").get("phase") == "Ready", what="roles gone")
