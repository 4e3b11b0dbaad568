"""``spec.engine.kvDiskTier`` and ``kvEvents`` (megatron_operator.kv_node): the disk tier's volume and flags, the KV
events endpoint (flags, ports, headless Service, ingress, ``status.kvEvents``), bad values refused naming the field
by the operator and the CRD, and the fields through the strict API-server double."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from megatron_operator import crd_kv_tiers, kv_node, spec
from megatron_operator.network import unauthenticated_ports
from megatron_operator.render import render

from .helpers import fake_coordinator_for, wait_for
from .test_kv_tiers_field import assert_engine_fields_refused, engine_container, example, parsed_args
from .test_operator_render import CONFIG, by_key, identified

pytestmark = pytest.mark.timeout(120)

INDEXER = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "kv-indexer"}}}


def engine_pod(resource: dict[str, Any]) -> dict[str, Any]:
    return by_key(render(identified(resource), CONFIG))[("StatefulSet", "llama-1b-engine-0")]["spec"]["template"]


def test_the_disk_tier_is_an_empty_dir_of_its_size_mounted_where_the_flags_point():
    resource = example(kvOffloadingSize=8, kvDiskTier={"size": 20.5})
    parsed = parsed_args(engine_container(resource))
    assert (parsed.kv_offloading_backend, parsed.kv_disk_dir, parsed.kv_disk_size) == ("disk", kv_node.DISK_MOUNT, 20.5)
    volumes = {v["name"]: v for v in engine_pod(resource)["spec"]["volumes"]}
    assert volumes[kv_node.DISK_VOLUME] == {"name": kv_node.DISK_VOLUME, "emptyDir": {"sizeLimit": "20992Mi"}}
    mounts = {m["name"]: m["mountPath"] for m in engine_container(resource)["volumeMounts"]}
    assert mounts[kv_node.DISK_VOLUME] == kv_node.DISK_MOUNT


def test_a_claim_name_mounts_the_claim_instead():
    resource = example(kvOffloadingSize=8, kvDiskTier={"size": 100, "claimName": "node-kv"})
    volumes = {v["name"]: v for v in engine_pod(resource)["spec"]["volumes"]}
    assert volumes[kv_node.DISK_VOLUME]["persistentVolumeClaim"] == {"claimName": "node-kv"}
    assert "emptyDir" not in volumes[kv_node.DISK_VOLUME]


def test_kv_events_reach_the_engines_as_vllm_s_config_with_ports_service_and_status():
    resource = example(kvEvents={"replayPort": 5558, "topic": "kv", "subscribers": [INDEXER]})
    engine = engine_container(resource)
    config = parsed_args(engine).kv_events_config  # the engine's own parser read vLLM's JSON
    assert config.publishes and (config.endpoint, config.replay_endpoint, config.topic) == (
        "tcp://*:5557", "tcp://*:5558", "kv")
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    assert (ports["kv-events"], ports["kv-replay"]) == (5557, 5558)
    objects = render(identified(resource), CONFIG)
    service = by_key(objects)[("Service", "llama-1b-kv-events")]
    assert service["spec"]["clusterIP"] == "None"  # resolves to every engine pod: an indexer subscribes to each
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "engine"
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("kv-events", 5557), ("kv-replay", 5558)]
    policy = by_key(objects)[("NetworkPolicy", "llama-1b-engine")]
    (rule,) = [r for r in policy["spec"]["ingress"] if INDEXER in r["from"]]
    assert sorted(p["port"] for p in rule["ports"]) == [5557, 5558]  # the indexer reaches those ports only
    assert unauthenticated_ports(objects) == []
    parsed = spec.parse(identified(resource))
    assert kv_node.events_status(parsed) == {"service": "llama-1b-kv-events.ml.svc", "port": 5557,
                                             "replayPort": 5558, "topic": "kv"}


def test_without_the_fields_nothing_changes():
    resource = example()
    engine = engine_container(resource)
    assert "--kv-offloading-backend" not in engine["args"] and "--kv-events-config" not in engine["args"]
    assert [p["name"] for p in engine["ports"]] == ["rendezvous"]
    assert kv_node.DISK_VOLUME not in {v["name"] for v in engine_pod(resource)["spec"]["volumes"]}
    assert ("Service", "llama-1b-kv-events") not in by_key(render(identified(resource), CONFIG))
    assert kv_node.events_status(spec.parse(identified(resource))) is None


BAD = {
    "a disk tier without a host tier": ({"kvDiskTier": {"size": 10}},
                                        "spec.engine: engine.kvDiskTier needs engine.kvOffloadingSize"),
    "a zero disk size": ({"kvOffloadingSize": 8, "kvDiskTier": {"size": 0}},
                         "spec.engine.kvDiskTier.size: must be greater than 0"),
    "a disk tier without a size": ({"kvOffloadingSize": 8, "kvDiskTier": {"claimName": "x"}},
                                   "spec.engine.kvDiskTier.size: required field is missing"),
    "an unknown disk field": ({"kvOffloadingSize": 8, "kvDiskTier": {"size": 1, "hostPath": "/mnt"}},
                              "spec.engine.kvDiskTier.hostPath: unknown field"),
    "an unknown events field": ({"kvEvents": {"endpoint": "tcp://*:1"}}, "spec.engine.kvEvents.endpoint: unknown field"),
    "a privileged events port": ({"kvEvents": {"port": 80}}, "spec.engine.kvEvents.port: must be at least 1024"),
    "the replay port on the events port": ({"kvEvents": {"port": 6000, "replayPort": 6000}},
                                           "spec.engine: engine.kvEvents.port and replayPort must differ"),
    "the events on the rendezvous port": ({"kvEvents": {"port": 29500}},
                                          "spec.engine: engine.kvEvents.port and replayPort must differ"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_values_are_refused_naming_the_field(case):
    assert_engine_fields_refused(BAD, case)


def test_the_cel_rules_agree_with_their_python_twins():
    import celpy

    env = celpy.Environment()
    engines = [{"kvCache": {"prefixCaching": True}, **host, **disk, **events}
               for host in ({}, {"kvOffloadingSize": 4}) for disk in ({}, {"kvDiskTier": {"size": 1}})
               for events in ({}, {"kvEvents": {"port": 5557}}, {"kvEvents": {"port": 29500}},
                              {"kvEvents": {"port": 5557, "replayPort": 5557}},
                              {"kvEvents": {"port": 5557, "replayPort": 5558}},
                              {"kvEvents": {"port": 5557, "replayPort": 29500}})]
    rules = [(rule, check) for where, rule, _, check in crd_kv_tiers.CEL_RULES
             if where == "spec.engine" and ("kvDiskTier" in rule or "kvEvents" in rule)]
    assert len(rules) == 2
    for rule, check in rules:
        program = env.program(env.compile(rule))
        for engine in engines:
            assert bool(program.evaluate({"self": celpy.json_to_cel(engine)})) == check(engine), (rule, engine)
        assert {check(e) for e in engines} == {True, False}


async def test_through_the_api_server_the_fields_render_and_report_and_their_removal_undoes_them(cluster):
    await cluster.install_crd()
    cluster.start_controllers()
    resource = copy.deepcopy(example(kvOffloadingSize=8, kvDiskTier={"size": 50}, kvEvents={"port": 6100}))
    resource["metadata"]["namespace"] = "default"
    await cluster.apply(resource)
    await cluster.start_operator(fake_coordinator_for(cluster, "default", "llama-1b"))
    await wait_for(lambda: cluster.status("default", "llama-1b").get("phase") == "Ready", what="phase Ready")
    assert cluster.status("default", "llama-1b")["kvEvents"] == {"service": "llama-1b-kv-events.default.svc",
                                                                 "port": 6100, "topic": ""}
    assert cluster.emu.find("services", "default", "llama-1b-kv-events") is not None

    def engine() -> dict[str, Any]:
        template = cluster.emu.find("statefulsets", "default", "llama-1b-engine-0")["spec"]["template"]
        (container,) = template["spec"]["containers"]
        return container

    assert parsed_args(engine()).kv_disk_size == 50.0
    await cluster.patch_mi("default", "llama-1b", {"spec": {"engine": {"kvDiskTier": None, "kvEvents": None}}})
    await wait_for(lambda: "--kv-offloading-backend" not in engine()["args"], what="the engines rolled")
    await wait_for(lambda: "kvEvents" not in cluster.status("default", "llama-1b"), what="status.kvEvents gone")
    await wait_for(lambda: cluster.emu.find("services", "default", "llama-1b-kv-events") is None,
                   what="the events Service deleted")
