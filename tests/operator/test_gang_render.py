"""Rendering of gangs (spec.engine.parallelism): every object validates (`kubernetes-validate --strict`,
LeaderWorkerSets against the LWS project's own CRD schema), `megatron-serve render -f` prints them, and
the rank wrappers give each pod its node rank and global rank in a real shell."""

from __future__ import annotations

import gzip
import io
import subprocess
from typing import Any

import jsonschema
import pytest
import yaml

from .helpers import ROOT, load_yaml, structural_json_schema

from megatron_operator import render as rendering
from megatron_operator.config import OperatorConfig
from megatron_operator.render import LWS_RANK_WRAPPER, RANK_WRAPPER, render

CONFIG = OperatorConfig(token_key=b"k")
K8S_VERSION = "1.33"
EXAMPLE = ROOT / "manifests" / "examples" / "moe-expert-parallel.yaml"
LWS_CRD = ROOT / "tests" / "operator" / "vendored_crds" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml.gz"


def example(uid: str | None = "3f1c2b9e-0d5e-4c53-9a57-6a1f7b0c9d21") -> dict[str, Any]:
    (doc,) = load_yaml(EXAMPLE)
    if uid:
        doc["metadata"].update(uid=uid, namespace="ml")
    return doc


@pytest.fixture(scope="module")
def lws_schema() -> dict[str, Any]:
    with gzip.open(LWS_CRD, "rt", encoding="utf-8") as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml: 650 kB
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return structural_json_schema(version["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("leader_worker_set", [False, True], ids=["statefulset", "leaderworkerset"])
def test_every_gang_object_validates(leader_worker_set, lws_schema):
    import kubernetes_validate

    for uid in (None, "3f1c2b9e-0d5e-4c53-9a57-6a1f7b0c9d21"):
        objects = render(example(uid), CONFIG, leader_worker_set=leader_worker_set)
        assert [o["kind"] for o in objects[6:]] == \
            (["LeaderWorkerSet"] * 2 if leader_worker_set else ["Service", "StatefulSet"] * 2) \
            + ["PodDisruptionBudget"] * 2  # the engine groups' and the coordinator's budgets
        for obj in objects:
            if obj["kind"] == "LeaderWorkerSet":
                errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                          for e in jsonschema.Draft4Validator(lws_schema).iter_errors(obj)]
                assert errors == []
                # and its pod template as the API server's own PodTemplate schema sees it
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                              "template": obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]},
                                             K8S_VERSION, strict=True)
            else:
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_schema_check_catches_a_bad_leaderworkerset(lws_schema):
    """Control: the vendored schema refuses what the LWS API server would (an unknown policy, a stray field)."""
    (lws, *_) = [o for o in render(example(), CONFIG, leader_worker_set=True) if o["kind"] == "LeaderWorkerSet"]
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RestartEverything"
    lws["spec"]["startupPolicy"] = "Whenever"
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["gpus"] = 8
    assert len(list(jsonschema.Draft4Validator(lws_schema).iter_errors(lws))) == 3


def test_gang_layout_and_sizes():
    objects = {(o["kind"], o["metadata"]["name"]): o for o in render(example(), CONFIG, leader_worker_set=True)}
    lws = objects[("LeaderWorkerSet", "qwen3-moe-engine-1")]
    assert lws["spec"]["replicas"] == 1 and lws["spec"]["startupPolicy"] == "LeaderCreated"
    template = lws["spec"]["leaderWorkerTemplate"]
    # one pod per attention rank (each an engine of 4 GPUs)
    assert template["size"] == 4 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    (engine,) = template["workerTemplate"]["spec"]["containers"]
    assert engine["command"] == ["/bin/sh", "-c", LWS_RANK_WRAPPER, "megatron-serve"]
    args = engine["args"]
    assert args[args.index("--group") + 1] == "1"
    assert args[args.index("--tensor-parallel-size") + 1] == "4" and "--tensor-parallel" not in args
    assert args[args.index("--data-parallel-size") + 1] == "4" and "--enable-expert-parallel" in args
    assert "--pipeline-parallel-size" not in args  # one stage: the engine's default
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert (env["WORLD_SIZE"], env["NNODES"], env["NPROC_PER_NODE"]) == ("16", "4", "4")
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 4
    # stopped engines: no group runs
    stopped = render(example(), CONFIG, leader_worker_set=True, engines_stopped=True)
    assert {o["spec"]["replicas"] for o in stopped if o["kind"] == "LeaderWorkerSet"} == {0}


def test_pipeline_stages_reach_the_engines():
    doc = example()
    doc["spec"]["engine"]["parallelism"] = {"tensor": 8, "pipeline": 2}
    sts = {o["metadata"]["name"]: o for o in render(doc, CONFIG) if o["kind"] == "StatefulSet"}["qwen3-moe-engine-0"]
    (engine,) = sts["spec"]["template"]["spec"]["containers"]
    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "8"
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert "--enable-expert-parallel" not in args and "--data-parallel-size" not in args
    assert sts["spec"]["replicas"] == 2 and engine["command"][2] == RANK_WRAPPER


@pytest.mark.parametrize("wrapper, env, node_rank", [
    (RANK_WRAPPER, {"HOSTNAME": "qwen3-moe-engine-0-1"}, 1),
    (LWS_RANK_WRAPPER, {"HOSTNAME": "qwen3-moe-engine-0-0-1", "LWS_WORKER_INDEX": "1",
                        "LWS_LEADER_ADDRESS": "qwen3-moe-engine-0-0.qwen3-moe-engine-0.ml"}, 1),
    (LWS_RANK_WRAPPER, {"HOSTNAME": "qwen3-moe-engine-0-0", "LWS_WORKER_INDEX": "0",
                        "LWS_LEADER_ADDRESS": "qwen3-moe-engine-0-0.qwen3-moe-engine-0.ml"}, 0),
])
def test_rank_wrappers_in_a_shell(tmp_path, wrapper, env, node_rank):
    """The wrapper's exec replaced by a script that prints what the engine would see."""
    fake = tmp_path / "megatron-serve"
    fake.write_text('#!/bin/sh\necho "$NODE_RANK $RANK $MASTER_ADDR $*"\n')
    fake.chmod(0o755)
    out = subprocess.run(["/bin/sh", "-c", wrapper, "megatron-serve", "engine", "--group", "0"], check=True,
                         capture_output=True, text=True,
                         env={"PATH": f"{tmp_path}:/usr/bin:/bin", "NPROC_PER_NODE": "8",
                              "MASTER_ADDR": "qwen3-moe-engine-0-0.qwen3-moe-engine-0.ml.svc", **env}).stdout.split()
    leader = env.get("LWS_LEADER_ADDRESS", "qwen3-moe-engine-0-0.qwen3-moe-engine-0.ml.svc")
    assert out == [str(node_rank), str(node_rank * 8), leader, "engine", "--group", "0"]


def test_render_command_prints_the_gangs(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_OPERATOR_TOKEN_KEY", "k")
    for option, kinds in ((False, {"StatefulSet"}), (True, {"LeaderWorkerSet"})):
        out, err = io.StringIO(), io.StringIO()
        assert rendering.render_command(str(EXAMPLE), out, err, leader_worker_set=option) == 0, err.getvalue()
        docs = list(yaml.safe_load_all(out.getvalue()))
        assert {d["kind"] for d in docs} & {"StatefulSet", "LeaderWorkerSet"} == kinds


def test_render_command_names_a_bad_layout(tmp_path):
    doc = example(uid=None)
    doc["spec"]["engine"]["parallelism"]["expert"] = 4
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    out, err = io.StringIO(), io.StringIO()
    assert rendering.render_command(str(path), out, err) == 1 and out.getvalue() == ""
    assert "engine.parallelism.expert must be 1" in err.getvalue()


@pytest.mark.parametrize("backend", ["auto", "deepep_low_latency"])
def test_the_all2all_backend_reaches_the_engines_away_from_auto(backend):
    """Issue 65: ``engine.parallelism.all2allBackend`` becomes the engines' ``--all2all-backend`` (auto, the engines'
    default, adds no flag: existing resources' pods stay as they are)."""
    doc = example()
    doc["spec"]["engine"]["parallelism"]["all2allBackend"] = backend
    sts = {o["metadata"]["name"]: o for o in render(doc, CONFIG) if o["kind"] == "StatefulSet"}
    args = sts["qwen3-moe-engine-0"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-expert-parallel" in args
    if backend == "auto":
        assert "--all2all-backend" not in args
    else:
        assert args[args.index("--all2all-backend") + 1] == backend
