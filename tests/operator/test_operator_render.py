"""Rendering: every example's children pass `kubernetes-validate --strict`, in a stable order,
with the names, labels, ranks, GPUs, probes and hardening of docs/reference/megatroninference.md; and the
`megatron-serve render -f FILE` entry point."""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import hmac
import io
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import pytest
import yaml

from .helpers import ROOT, load_yaml

from megatron_operator import cli, render as rendering, spec
from megatron_operator.config import OperatorConfig
from megatron_operator.render import render

CONFIG = OperatorConfig(token_key=b"k")
K8S_VERSION = "1.33"


def identified(resource: dict[str, Any], uid: str = "0b7d9c52-3f3e-4a5e-9d0e-2f4b1f1f2a10",
               namespace: str = "ml") -> dict[str, Any]:
    out = copy.deepcopy(resource)
    out["metadata"].update(uid=uid, namespace=namespace)
    return out


def by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def test_every_rendered_object_passes_kubernetes_validate_strict(example):
    import kubernetes_validate

    for resource in (example, identified(example)):
        for obj in render(resource, CONFIG):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_stable_order_and_deterministic(example):
    first = render(identified(example), CONFIG)
    second = render(identified(copy.deepcopy(example)), CONFIG)
    assert first == second
    assert rendering.to_yaml(first) == rendering.to_yaml(second)
    kinds = [o["kind"] for o in first]
    data = example["spec"]["parallelism"]["data"]
    assert kinds == ["Secret", "Service", "Service", "NetworkPolicy", "NetworkPolicy", "Deployment"] + \
        ["Service", "StatefulSet"] * data + ["PodDisruptionBudget", "PodDisruptionBudget"]
    name = example["metadata"]["name"]
    assert [o["metadata"]["name"] for o in first[:6]] == [
        f"{name}-coordinator-token", name, f"{name}-coordinator", f"{name}-coordinator", f"{name}-engine",
        f"{name}-coordinator"]
    assert [o["metadata"]["name"] for o in first[6:-2:2]] == [f"{name}-engine-{g}" for g in range(data)]
    assert [o["metadata"]["name"] for o in first[-2:]] == [f"{name}-engine", f"{name}-coordinator"]


def test_labels_owner_and_namespace(example):
    resource = identified(example)
    name = resource["metadata"]["name"]
    for obj in render(resource, CONFIG):
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["labels"]["app.kubernetes.io/instance"] == name
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "megatron-operator"
        assert meta["ownerReferences"] == [{"apiVersion": "serving.megatron.dev/v1alpha1", "kind": "MegatronInference",
                                            "name": name, "uid": resource["metadata"]["uid"], "controller": True}]
    # without a uid (a file not yet applied) there is nothing to own by
    assert all("ownerReferences" not in o["metadata"] for o in render(example, CONFIG))


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj["spec"]["template"]["spec"]["containers"]


def engine_command(**engine: Any) -> tuple[str, list[str]]:
    """The first engine group's command and its arguments, rendered from the tp2-dp4 example with ``engine``'s fields
    set in ``spec.engine`` (a None value leaves its field out)."""
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "tp2-dp4.yaml")
    resource["spec"]["engine"].update({name: value for name, value in engine.items() if value is not None})
    sts = by_key(render(identified(resource), CONFIG))[("StatefulSet", "qwen-14b-engine-0")]
    (container,) = _containers(sts)
    command, *args = container["args"]
    return command, args


def test_pods_are_hardened_and_probed(example):
    for obj in render(example, CONFIG):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        assert pod["terminationGracePeriodSeconds"] == example["spec"].get("drainTimeoutSeconds", 60) + 30
        mounts_tmp = True
        for c in pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            mounts_tmp &= any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]} and sc["privileged"] is False
            assert c["readinessProbe"] and c["livenessProbe"]
            mounts_tmp &= any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])
            token = next(e for e in c["env"] if e["name"] == "MEGATRON_SERVE_TOKEN")
            assert token["valueFrom"]["secretKeyRef"]["name"].endswith("-coordinator-token")
        assert mounts_tmp
        if obj["kind"] == "StatefulSet":
            (engine,) = pod["containers"]
            assert engine["lifecycle"]["preStop"]["exec"]["command"][0] == "/bin/sh"
            assert engine["startupProbe"]["failureThreshold"] * engine["startupProbe"]["periodSeconds"] >= 1800


def test_coordinator_pod_runs_coordinator_and_server():
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "rl-rollout-paused.yaml")
    objs = by_key(render(identified(resource), CONFIG))
    deploy = objs[("Deployment", "rollout-coordinator")]
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    coordinator, server = _containers(deploy)
    assert coordinator["args"] == ["coordinator", "--model", "/models/policy/qwen3-8b", "--port", "5555",
                                   "--routing", "round_robin"]
    assert server["args"] == ["server", "--model", "/models/policy/qwen3-8b", "--coordinator", "tcp://127.0.0.1:5555",
                              "--host", "0.0.0.0", "--port", "8000", "--drain-timeout",
                              str(resource["spec"]["drainTimeoutSeconds"]), "--health-port", "8001"]
    api_key = next(e for e in server["env"] if e["name"] == "MEGATRON_SERVE_API_KEY")
    assert api_key["valueFrom"]["secretKeyRef"] == {"name": "rollout-api-key", "key": "api-key"}
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    mount = next(m for m in coordinator["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models/policy", "readOnly": True}
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "rl-checkpoints"}} in \
        deploy["spec"]["template"]["spec"]["volumes"]
    svc = objs[("Service", "rollout")]
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert objs[("Service", "rollout-coordinator")]["spec"]["ports"][0]["port"] == 5555
    # the paused fleet's engines still run: Paused keeps memory, only Shutdown scales to zero
    assert all(o["spec"]["replicas"] == 1 for k, o in objs.items() if k[0] == "StatefulSet")


def test_engine_groups_gpus_and_rendezvous():
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "tp2-dp4.yaml")
    objs = by_key(render(identified(resource), CONFIG))
    for g in range(4):
        sts = objs[("StatefulSet", f"qwen-14b-engine-{g}")]
        svc = objs[("Service", f"qwen-14b-engine-{g}")]
        assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
        assert sts["spec"]["podManagementPolicy"] == "Parallel" and sts["spec"]["replicas"] == 1
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
        assert svc["spec"]["selector"]["serving.megatron.dev/group"] == str(g)
        (engine,) = _containers(sts)
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 2  # a 2-rank group on an 8-GPU node
        assert engine["resources"]["requests"] == {"cpu": "8", "memory": "128Gi", "nvidia.com/gpu": 2}
        args = engine["args"]
        assert args[:9] == ["engine", "--model", "/models/qwen2.5-14b-instruct", "--coordinator",
                            "tcp://qwen-14b-coordinator.ml.svc:5555", "--group", str(g), "--tensor-parallel", "2"]
        assert args[-2:] == ["--drain-timeout", "60"]
        assert "command" not in engine  # one pod per group: the image entrypoint runs directly
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert env["MASTER_ADDR"] == f"qwen-14b-engine-{g}-0.qwen-14b-engine-{g}.ml.svc"
        assert (env["WORLD_SIZE"], env["RANK"], env["NNODES"], env["NPROC_PER_NODE"]) == ("2", "0", "1", "2")


def test_multi_node_group_derives_ranks_from_the_pod_ordinal(tmp_path: pathlib.Path):
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "multi-node.yaml")
    sts = by_key(render(resource, CONFIG))[("StatefulSet", "llama-405b-engine-1")]
    assert sts["spec"]["replicas"] == 2
    (engine,) = _containers(sts)
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert (env["WORLD_SIZE"], env["NNODES"], env["NPROC_PER_NODE"]) == ("16", "2", "8")
    assert "RANK" not in env and env["MASTER_ADDR"] == "llama-405b-engine-1-0.llama-405b-engine-1.default.svc"
    # run the rendered wrapper with a stand-in megatron-serve: pod 1 gets node rank 1, rank 8
    fake = tmp_path / "megatron-serve"
    fake.write_text('#!/bin/sh\necho "NODE_RANK=$NODE_RANK RANK=$RANK ARGS=$*"\n')
    fake.chmod(0o755)
    run_env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOSTNAME": "llama-405b-engine-1-1",
               **{k: v for k, v in env.items() if v is not None}}
    out = subprocess.run([*engine["command"], *engine["args"][:3]], env=run_env, capture_output=True, text=True,
                         check=True, timeout=10).stdout
    assert out.strip() == "NODE_RANK=1 RANK=8 ARGS=engine --model /models/llama-3.1-405b-instruct"


def test_token_is_stable_and_per_resource():
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "single-gpu.yaml")
    secret = render(identified(resource), CONFIG)[0]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 64
    assert render(identified(resource), CONFIG)[0] == secret
    assert render(identified(resource, uid="another"), CONFIG)[0] != secret
    assert render(identified(resource), OperatorConfig(token_key=b"other"))[0] != secret
    # the operator keeps an existing Secret's token
    kept = render(identified(resource), CONFIG, token="existing")[0]
    assert base64.b64decode(kept["data"]["token"]) == b"existing"


def test_shutdown_scales_engines_to_zero():
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "tp2-dp4.yaml")
    resource["spec"]["lifecycle"] = "Shutdown"
    objs = render(resource, CONFIG)
    assert [o["spec"]["replicas"] for o in objs if o["kind"] == "StatefulSet"] == [0, 0, 0, 0]
    assert by_key(objs)[("Deployment", "qwen-14b-coordinator")]["spec"]["replicas"] == 1
    held = render(resource, CONFIG, engines_stopped=False)  # until the coordinator acknowledged STOP
    assert [o["spec"]["replicas"] for o in held if o["kind"] == "StatefulSet"] == [1, 1, 1, 1]


# --------------------------------------------------------------------------- the command

def test_render_command_prints_a_yaml_stream(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.setenv("MEGATRON_OPERATOR_TOKEN_KEY", "k")
    path = ROOT / "manifests" / "examples" / "tp2-dp4.yaml"
    assert cli.render_command(str(path)) == 0
    out = capsys.readouterr().out
    docs = list(yaml.safe_load_all(out))
    (resource,) = load_yaml(path)
    assert docs == render(resource, CONFIG)
    assert out.startswith("---\n") and out.count("\n---\n") == len(docs) - 1
    # the subcommand module, as megatron_serve.cli calls it
    from megatron_operator.commands import render as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert command.run(parser.parse_args(["-f", str(path)])) == 0
    assert capsys.readouterr().out == out


def test_render_command_rejects_invalid_resources(tmp_path: pathlib.Path):
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "tp2-dp4.yaml")
    resource["spec"]["parallelism"]["tensor"] = 3
    resource["spec"]["lifecycle"] = "Sleeping"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(resource))
    out, err = io.StringIO(), io.StringIO()
    assert rendering.render_command(str(path), out=out, err=err) == 1
    assert out.getvalue() == ""
    text = err.getvalue()
    assert "MegatronInference/qwen-14b: spec.lifecycle: unsupported value 'Sleeping'" in text
    assert rendering.render_command(str(tmp_path / "missing.yaml"), out=out, err=io.StringIO()) == 1
    path.write_text("kind: [unclosed")
    err = io.StringIO()
    assert rendering.render_command(str(path), out=out, err=err) == 1 and "not valid YAML" in err.getvalue()
    # the CEL rule shows once the enum is fixed
    resource["spec"]["lifecycle"] = "Running"
    path.write_text(yaml.safe_dump(resource))
    err = io.StringIO()
    assert rendering.render_command(str(path), out=out, err=err) == 1
    assert "multiple or a divisor of engine.gpusPerPod" in err.getvalue()


def secret_token(text: str) -> str:
    secret = next(doc for doc in yaml.safe_load_all(text) if doc["kind"] == "Secret")
    return base64.b64decode(secret["data"]["token"]).decode()


def test_render_without_a_key_never_emits_a_derivable_token(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path):
    monkeypatch.delenv("MEGATRON_OPERATOR_TOKEN_KEY", raising=False)
    monkeypatch.delenv("MEGATRON_OPERATOR_TOKEN_KEY_FILE", raising=False)
    path = str(ROOT / "manifests" / "examples" / "single-gpu.yaml")
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "single-gpu.yaml")
    tokens = []
    for _ in range(2):
        out, err = io.StringIO(), io.StringIO()
        assert rendering.render_command(path, out=out, err=err) == 0
        assert "random token" in err.getvalue() and "--token-key-file" in err.getvalue()
        tokens.append(secret_token(out.getvalue()))
    assert tokens[0] != tokens[1] and all(len(t) == 64 for t in tokens)
    # not the HMAC of the resource under the key that used to be written in the source
    public = hmac.new(b"megatron-serve-render-only", f"{resource['metadata'].get('namespace', 'default')}/"
                      f"{resource['metadata']['name']}/".encode(), hashlib.sha256).hexdigest()
    assert public not in tokens

    key_file = tmp_path / "key"
    key_file.write_text("operator-key\n")
    out, err = io.StringIO(), io.StringIO()
    assert rendering.render_command(path, out=out, err=err, token_key_file=str(key_file)) == 0
    assert err.getvalue() == ""
    assert secret_token(out.getvalue()) == rendering.derive_token(b"operator-key", "default",
                                                                  resource["metadata"]["name"], None)
    assert list(yaml.safe_load_all(out.getvalue())) == \
        render(resource, OperatorConfig(token_key=b"operator-key"))  # what the operator creates
    missing = io.StringIO()
    assert rendering.render_command(path, out=io.StringIO(), err=missing,
                                    token_key_file=str(tmp_path / "nope")) == 2
    assert "--token-key-file" in missing.getvalue()


def test_module_entry_point_renders(tmp_path: pathlib.Path):
    env = dict(os.environ, MEGATRON_OPERATOR_TOKEN_KEY="k")
    proc = subprocess.run([sys.executable, "-m", "megatron_operator", "render", "-f",
                           str(ROOT / "manifests" / "examples" / "single-gpu.yaml")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert len(list(yaml.safe_load_all(proc.stdout))) == 10  # 6 fleet objects, 1 group, 2 budgets


def test_kopf_arguments():
    assert cli.kopf_argv([]) == ["run", "--module", "megatron_operator.handlers", "--all-namespaces"]
    assert cli.kopf_argv(["--standalone", "-n", "ml"]) == \
        ["run", "--module", "megatron_operator.handlers", "--standalone", "-n", "ml"]
    assert cli.kopf_argv(["--", "-A", "--standalone"])[-2:] == ["-A", "--standalone"]
    assert shutil.which("sh")  # the rank wrapper's shell exists where tests run


def _parser_for(command: str) -> argparse.ArgumentParser | None:
    import importlib

    from megatron_serve import cli as serve_cli

    if command not in serve_cli.COMMANDS:
        return None
    parser = argparse.ArgumentParser(prog=f"megatron-serve {command}", exit_on_error=False)
    importlib.import_module(serve_cli.COMMANDS[command][0]).add_arguments(parser)
    return parser


def _runtime_lacks(flag: str) -> bool:
    parser = _parser_for("engine")
    return parser is not None and flag not in parser._option_string_actions


def test_rendered_commands_parse_with_the_runtime_cli(example):
    """The containers' argument lists are accepted by the runtime's own subcommand parsers."""
    model_path = spec.parse(example).model_path
    for obj in render(example, CONFIG):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in [*obj["spec"]["template"]["spec"].get("initContainers", []), *_containers(obj)]:
            command, *args = container["args"]
            parser = _parser_for(command)
            assert parser is not None, f"megatron-serve {command} is not a registered command"
            try:
                parsed, unknown = parser.parse_known_args(args)
            except (argparse.ArgumentError, SystemExit) as exc:
                raise AssertionError(f"{container['name']}: {args}: {exc}") from None
            assert unknown == [], f"{container['name']}: unknown arguments {unknown}"
            assert parsed.model == (model_path if command != "download" else example["spec"]["model"]["hub"])


def test_wiring_into_the_megatron_serve_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """The subcommand modules work through megatron_serve.cli.main, as registered in its COMMANDS."""
    from megatron_serve import cli as serve_cli

    monkeypatch.setenv("MEGATRON_OPERATOR_TOKEN_KEY", "k")
    path = str(ROOT / "manifests" / "examples" / "single-gpu.yaml")
    assert serve_cli.main(["render", "-f", path]) == 0
    assert len(list(yaml.safe_load_all(capsys.readouterr().out))) == 10
    seen: list[list[str]] = []
    monkeypatch.setattr(cli, "operator_command", lambda extra: seen.append(list(extra)) or 0)
    assert serve_cli.main(["operator", "-n", "ml", "--standalone", "--liveness=http://0.0.0.0:8080/healthz"]) == 0
    assert cli.kopf_argv(seen[-1]) == ["run", "--module", "megatron_operator.handlers", "-n", "ml", "--standalone",
                                       "--liveness=http://0.0.0.0:8080/healthz"]
    assert serve_cli.main(["operator"]) == 0 and seen[-1] == []


@pytest.mark.parametrize("cuda_graphs", [None, True, False])
def test_engine_cuda_graphs_switch_reaches_the_engine_command(cuda_graphs):
    command, args = engine_command(cudaGraphs=cuda_graphs)
    # Off only when asked: the default adds no flag, so pod templates rendered before the field existed still match.
    assert ("--no-cuda-graphs" in args) is (cuda_graphs is False)
    assert not any(a == "--cuda-graphs" for a in args)
    parsed, _ = _parser_for(command).parse_known_args(args)
    assert parsed.cuda_graphs is (cuda_graphs is not False)


@pytest.mark.parametrize(("fields", "flags"), [
    ({}, []),
    ({"quantization": "none", "kvCacheDtype": "auto"}, []),
    ({"quantization": "fp8"}, ["--quantization", "fp8"]),
    ({"kvCacheDtype": "fp8"}, ["--kv-cache-dtype", "fp8"]),
    ({"quantization": "fp8", "kvCacheDtype": "fp8"}, ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]),
])
def test_engine_fp8_fields_reach_the_engine_command(fields, flags):
    command, args = engine_command(**fields)
    # Defaults add no flag, so pod templates rendered before the fields existed still match.
    rendered = [a for i, a in enumerate(args) if a in ("--quantization", "--kv-cache-dtype")
                or (i and args[i - 1] in ("--quantization", "--kv-cache-dtype"))]
    assert rendered == flags
    parsed, _ = _parser_for(command).parse_known_args(args)
    assert parsed.quantization == {"none": None, "fp8": "fp8"}[fields.get("quantization", "none")]
    assert parsed.kv_cache_dtype == fields.get("kvCacheDtype", "auto")


@pytest.mark.parametrize("remote_images", [None, True, False])
def test_server_remote_images_switch_reaches_the_server_command(remote_images):
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "tp2-dp4.yaml")
    if remote_images is not None:
        resource["spec"].setdefault("server", {})["remoteImages"] = remote_images
    deployment = by_key(render(identified(resource), CONFIG))[("Deployment", "qwen-14b-coordinator")]
    (server,) = [c for c in _containers(deployment) if c["name"] == "server"]
    command, *args = server["args"]
    # Off only when asked: the default adds no flag, so pod templates rendered before the field existed still match.
    assert ("--no-remote-images" in args) is (remote_images is False)
    parsed, _ = _parser_for(command).parse_known_args(args)
    assert parsed.remote_images is (remote_images is not False)


@pytest.mark.parametrize("count", [None, 1, 3])
def test_server_api_server_count_reaches_the_server_command(count):
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "tp2-dp4.yaml")
    resource["spec"]["server"].pop("apiServerCount")  # the example sets it
    if count is not None:
        resource["spec"]["server"]["apiServerCount"] = count
    deployment = by_key(render(identified(resource), CONFIG))[("Deployment", "qwen-14b-coordinator")]
    (server,) = [c for c in _containers(deployment) if c["name"] == "server"]
    command, *args = server["args"]
    # One process adds no flag, so pod templates rendered before the field existed still match.
    assert ("--api-server-count" in args) is (count == 3)
    parsed, _ = _parser_for(command).parse_known_args(args)
    assert parsed.api_server_count == (count or 1)


@pytest.mark.parametrize("volume", [None, {"persistentVolumeClaim": {"claimName": "models"}}])
def test_a_hub_model_is_fetched_by_an_init_container_into_the_model_volume(volume):
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "hub-model.yaml")
    resource["spec"]["model"]["hubTokenSecretRef"] = {"name": "hf", "key": "token"}
    if volume is not None:
        resource["spec"]["model"].update(volume=volume, path="/models/qwen3")
    objs = by_key(render(identified(resource), CONFIG))
    fetched = "/models/qwen3" if volume else "/models/Qwen/Qwen3-0.6B"
    for (kind, name), weights in ((("Deployment", "qwen3-small-coordinator"), False),
                                  (("StatefulSet", "qwen3-small-engine-0"), True)):
        pod = objs[(kind, name)]["spec"]["template"]["spec"]
        (fetch,) = pod["initContainers"]
        assert fetch["args"] == ["download", "Qwen/Qwen3-0.6B", "--local-dir", fetched,
                                 *([] if weights else ["--skip-weights"])]
        assert fetch["image"] == pod["containers"][0]["image"]
        env = {e["name"]: e for e in fetch["env"]}
        assert env["HF_HUB_OFFLINE"]["value"] == "0"  # the image is offline; the fetch is not
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
        assert {"name": "model", "mountPath": "/models"} in fetch["volumeMounts"]  # writable here only
        assert {"name": "model", **(volume or {"emptyDir": {}})} in pod["volumes"]
        for container in pod["containers"]:
            assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
            assert container["args"][container["args"].index("--model") + 1] == fetched
    server = _containers(objs[("Deployment", "qwen3-small-coordinator")])[1]
    assert server["args"][-2:] == ["--served-model-name", "Qwen/Qwen3-0.6B"]  # named by its id, as in vLLM
    no_hub = by_key(render(identified(load_yaml(ROOT / "manifests" / "examples" / "single-gpu.yaml")[0]), CONFIG))
    assert all("initContainers" not in o["spec"]["template"]["spec"] for o in no_hub.values() if "template" in
               o.get("spec", {}))


@pytest.mark.parametrize(("speculative", "expected"), [
    (None, None),
    ({"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 5},
     {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 5}),
    ({"method": "draft_model", "model": "/models/draft"},
     {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
      "prompt_lookup_max": 3}),
    ({"method": "mtp", "numSpeculativeTokens": 2},
     {"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    ({"method": "eagle3", "model": "/models/eagle3"},
     {"method": "eagle3", "model": "/models/eagle3", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
      "prompt_lookup_max": 3}),
    ({"method": "ngram", "adaptive": False},
     {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": False}),
])
def test_engine_speculative_reaches_the_engine_command_as_vllms_json(speculative, expected):
    command, args = engine_command(speculative=speculative)
    assert ("--speculative-config" in args) is (speculative is not None)  # off: no flag, templates unchanged
    parsed, _ = _parser_for(command).parse_known_args(args)
    assert parsed.speculative_config == expected
    if expected is not None:  # the engine builds its config from it, every field understood
        from megatron_serve.config import SpeculativeConfig  # noqa: PLC0415

        SpeculativeConfig.from_dict(parsed.speculative_config)


@pytest.mark.parametrize("file, data, budget, available", [
    ("single-gpu.yaml", 3, {}, 2),  # the default: one group of three may go
    ("single-gpu.yaml", 3, {"maxUnavailableGroups": 0}, 3),  # no engine pod may be evicted
    ("single-gpu.yaml", 3, {"maxUnavailableGroups": 5}, 0),  # more than there are: every pod may go
    ("single-gpu.yaml", 0, {}, 0),  # scaled to zero
    ("multi-node.yaml", 3, {}, 4),  # two pods a group: two groups' pods stay
])
def test_the_engine_budget_is_a_count_of_ready_pods(file, data, budget, available):
    """``minAvailable`` (what the disruption controller compares with the Ready pods alone), never
    ``maxUnavailable``, whose expected count leaves out a group whose StatefulSet has no pod yet: the budget would
    let a second group go while the first one's replacement is not made (test_real_disruption.py shows both)."""
    (example,) = load_yaml(ROOT / "manifests" / "examples" / file)
    resource = identified(example)
    resource["spec"]["parallelism"]["data"] = data
    resource["spec"]["disruptionBudget"] = budget
    engine = by_key(render(resource, CONFIG))[("PodDisruptionBudget", f"{resource['metadata']['name']}-engine")]
    assert engine["spec"]["minAvailable"] == available
    assert "maxUnavailable" not in engine["spec"]
    assert engine["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
