"""``spec.lora`` reaches the engine command as vLLM's LoRA flags (parsed back by the engine's own parser), its
volume is mounted read-only in the engine pods only, and a resource without it renders exactly as before."""

from __future__ import annotations

import copy

from megatron_operator import spec
from megatron_operator.render import render

from .helpers import ROOT, load_yaml
from .test_operator_render import CONFIG, _containers, _parser_for, by_key, identified


def engine_and_pod(resource: dict) -> tuple[dict, dict]:
    sts = by_key(render(identified(resource), CONFIG))[("StatefulSet", f"{resource['metadata']['name']}-engine-0")]
    (engine,) = _containers(sts)
    return engine, sts["spec"]["template"]["spec"]


def test_adapters_from_a_volume_reach_the_engines():
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "lora-adapters.yaml")
    engine, pod = engine_and_pod(resource)
    command, *args = engine["args"]
    parsed, _ = _parser_for(command).parse_known_args(args)
    assert (parsed.enable_lora, parsed.max_loras, parsed.max_lora_rank, parsed.max_cpu_loras) == (True, 4, 32, None)
    assert dict(parsed.lora_modules) == {"sql": "/adapters/sql-lora", "support": "/adapters/support-lora",
                                         "summarize": "/adapters/summarize-lora"}
    assert {"name": "lora", "persistentVolumeClaim": {"claimName": "lora-adapters", "readOnly": True}} in pod["volumes"]
    assert {"name": "lora", "mountPath": "/adapters", "readOnly": True} in engine["volumeMounts"]
    coordinator_pod = by_key(render(identified(resource), CONFIG))[("Deployment", "llama-8b-lora-coordinator")]
    assert all(v["name"] != "lora" for v in coordinator_pod["spec"]["template"]["spec"]["volumes"])


def test_lora_without_adapters_or_volume_enables_lora_for_runtime_loads():
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "single-gpu.yaml")
    plain_engine, plain_pod = engine_and_pod(copy.deepcopy(resource))
    resource["spec"]["lora"] = {"maxCpuLoras": 8}
    engine, pod = engine_and_pod(resource)
    command, *args = engine["args"]
    parsed, _ = _parser_for(command).parse_known_args(args)
    assert (parsed.enable_lora, parsed.max_loras, parsed.max_lora_rank, parsed.max_cpu_loras) == (True, 1, 16, 8)
    assert parsed.lora_modules is None and pod["volumes"] == plain_pod["volumes"]
    assert engine["args"][:len(plain_engine["args"]) - 2] == plain_engine["args"][:-2]  # the same, plus the flags
    assert "--enable-lora" not in plain_engine["args"] and spec.parse(identified(resource)).lora["adapters"] == []
