"""A rendered gang's engine pods start: each pod's container, its rank wrapper run in a real shell, gives the engine
an environment and a command line that the engine's own parser, layout checks (``megatron-serve engine``'s
:func:`layout_config`) and placement (the one its processes start from) accept, and the pods' ranks cover the
group exactly once. With data-parallel attention each pod is one attention rank (``NPROC_PER_NODE`` = its tensor
width); the control shows the engine refusing a pod that holds two."""

from __future__ import annotations

import argparse
import json
import subprocess
from typing import Any

import pytest

from .test_gang_render import CONFIG, example

from megatron_operator.render import render
from megatron_serve.commands import engine as engine_command
from megatron_serve.engine.group.placement import Placement, data_parallel_placement, placement_for

ENV_NAMES = ("NODE_RANK", "RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NNODES", "NPROC_PER_NODE")


def engine_template(doc: dict[str, Any], leader_worker_set: bool) -> tuple[dict[str, Any], int]:
    """Group 0's pod template and pod count, as the operator renders them."""
    (gang,) = [o for o in render(doc, CONFIG, leader_worker_set=leader_worker_set)
               if o["kind"] in ("StatefulSet", "LeaderWorkerSet") and o["metadata"]["name"].endswith("-engine-0")]
    if leader_worker_set:
        template = gang["spec"]["leaderWorkerTemplate"]
        return template["workerTemplate"], template["size"]
    return gang["spec"]["template"], gang["spec"]["replicas"]


def pod_view(container: dict[str, Any], pod: int, leader_worker_set: bool, tmp_path) -> tuple[dict[str, str], list]:
    """What the engine of pod ``pod`` sees: its environment and arguments after the container's wrapper (if any),
    from a stand-in ``megatron-serve`` that prints them."""
    fake = tmp_path / "megatron-serve"
    fake.write_text("#!/bin/sh\nexec python3 -c 'import json, os, sys; print(json.dumps([dict(os.environ), "
                    "sys.argv[1:]]))' \"$@\"\n")
    fake.chmod(0o755)
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    leader = env["MASTER_ADDR"]
    if leader_worker_set:
        env |= {"LWS_WORKER_INDEX": str(pod), "LWS_LEADER_ADDRESS": leader, "HOSTNAME": f"moe-engine-0-0-{pod}"}
    else:
        env["HOSTNAME"] = f"qwen3-moe-engine-0-{pod}"
    command = container.get("command", ["megatron-serve"])
    out = subprocess.run([*command, *container["args"]], check=True, capture_output=True, text=True,
                         env={"PATH": f"{tmp_path}:/usr/bin:/bin", **env}).stdout
    seen, argv = json.loads(out)
    return {name: seen[name] for name in ENV_NAMES if name in seen}, argv


def engine_placement(argv: list[str], env: dict[str, str], monkeypatch) -> tuple[Placement, int]:
    """The placement ``megatron-serve engine`` would start this pod's ranks with, and its data-parallel rank."""
    command, *args = argv
    assert command == "engine"
    parser = argparse.ArgumentParser(prog="megatron-serve engine", exit_on_error=False)
    engine_command.add_arguments(parser)
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = engine_command.layout_config(parser.parse_args(args))
    if config.data_parallel_size > 1:
        return data_parallel_placement(config), config.data_parallel_rank
    return placement_for(config.world_size), 0


LAYOUTS = {  # (gpusPerPod, engine.parallelism) -> (pods, GPUs per pod)
    "issue layout, 2 GPUs a pod": (2, {"tensor": 2, "expert": 2, "dataParallelAttention": 2}, 2, 1),
    "issue layout, 4 GPUs a pod": (4, {"tensor": 2, "expert": 2, "dataParallelAttention": 2}, 2, 1),
    "tp 2 x dp 2 on 8-GPU nodes": (8, {"tensor": 4, "expert": 4, "dataParallelAttention": 2}, 2, 2),
    "the example: tp 4 x dp 4 on 8-GPU nodes": (8, {"tensor": 16, "expert": 16, "dataParallelAttention": 4}, 4, 4),
    "expert parallel over tp 16, no dp": (8, {"tensor": 16, "expert": 16}, 2, 8),
}


@pytest.mark.parametrize("leader_worker_set", [False, True], ids=["statefulset", "leaderworkerset"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_pod_of_a_gang_starts_its_share_of_the_ranks(layout, leader_worker_set, tmp_path, monkeypatch):
    gpus_per_pod, parallelism, pods, gpus = LAYOUTS[layout]
    doc = example()
    doc["spec"]["engine"].update(gpusPerPod=gpus_per_pod, parallelism=parallelism)
    template, size = engine_template(doc, leader_worker_set)
    assert size == pods
    (container,) = template["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    started: list[int] = []
    for pod in range(pods):
        env, argv = pod_view(container, pod, leader_worker_set, tmp_path)
        placement, data_rank = engine_placement(argv, env, monkeypatch)
        assert placement.local_count == gpus and placement.world_size == parallelism["tensor"]
        if parallelism.get("dataParallelAttention", 1) > 1:
            assert data_rank == pod  # pod d is data-parallel rank d
        started += range(placement.first_local_rank, placement.first_local_rank + placement.local_count)
    assert started == list(range(parallelism["tensor"]))  # every rank of the group, once


def test_control_an_engine_refuses_a_pod_holding_two_attention_ranks(tmp_path, monkeypatch):
    """The check the rendering satisfies bites: the example's pods as they were rendered before (8 GPUs, two
    attention ranks of 4 each) are refused at start, naming NPROC_PER_NODE."""
    template, _ = engine_template(example(), leader_worker_set=False)
    (container,) = template["spec"]["containers"]
    env, argv = pod_view(container, 0, False, tmp_path)
    with pytest.raises(ValueError, match="NPROC_PER_NODE=8, but an engine of data-parallel attention starts its own 4"):
        engine_placement(argv, {**env, "NPROC_PER_NODE": "8"}, monkeypatch)
