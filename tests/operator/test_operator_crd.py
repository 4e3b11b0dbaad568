"""The CRD: files equal its source, the schema is structural, examples validate against it
(jsonschema for the structure, cel-python for the CEL rules), bad resources are rejected with
readable reasons, and the operator's Python validation agrees with the CRD on all of them."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest

from .helpers import CRD_PATH, EXAMPLES, ROOT, load_yaml, structural_json_schema
from .test_operator_render import identified

from megatron_operator import crd, spec

CHART_CRD = ROOT / "charts" / "megatron-operator" / "crds" / "serving.megatron.dev_megatroninferences.yaml"


def test_crd_files_equal_the_source_and_each_other():
    assert CRD_PATH.read_text() == crd.crd_yaml()
    assert CHART_CRD.read_bytes() == CRD_PATH.read_bytes()
    (doc,) = load_yaml(CRD_PATH)
    assert doc == crd.crd()


def test_crd_is_a_valid_kubernetes_object():
    import kubernetes_validate

    (doc,) = load_yaml(CRD_PATH)
    kubernetes_validate.validate(doc, "1.33", strict=True)
    version = doc["spec"]["versions"][0]
    assert doc["spec"]["names"]["shortNames"] == ["mi"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.parallelism.data"
    assert version["subresources"]["status"] == {}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == \
        ["Phase", "Lifecycle", "Ready Engines", "Desired", "Endpoint", "Age"]


def _walk(schema: dict[str, Any], path: str = ""):
    yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    """The rules of https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/
    custom-resource-definitions/#specifying-a-structural-schema that a typo could break."""
    schema = crd.openapi_schema()
    for path, node in _walk(schema):
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert "type" in node, f"{path}: every node needs a type"
        if node["type"] == "object" and "properties" in node:
            assert "additionalProperties" not in node, path
        if "default" in node:
            errors: list[str] = []
            spec.check_schema(copy.deepcopy(node["default"]), node, path, errors)
            assert not errors, errors
        for rule in node.get("x-kubernetes-validations", []):
            assert rule["rule"] in crd.CEL_CHECKS and rule["message"], path


# --------------------------------------------------------------------------- a reference validator

def _default(value: Any, node: dict[str, Any]) -> Any:
    """The API server's structural defaulting, written independently of megatron_operator.spec."""
    if isinstance(value, dict):
        for name, sub in (node.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default(value[name], sub)
    return value


def _cel_errors(value: Any, node: dict[str, Any], path: str = "") -> list[str]:
    import celpy

    errors: list[str] = []
    if isinstance(value, dict):
        for name, sub in (node.get("properties") or {}).items():
            if name in value and name != "metadata":
                errors += _cel_errors(value[name], sub, f"{path}.{name}")
    env = celpy.Environment()
    for rule in node.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        try:
            ok = bool(program.evaluate({"self": celpy.json_to_cel(value)}))
        except Exception:  # a failing rule is a rejection in the API server too
            ok = False
        if not ok:
            errors.append(f"{path or '(root)'}: {rule['message']}")
    return errors


def _duplicate_keys(value: Any, node: dict[str, Any], path: str = "") -> list[str]:
    """Items of an ``x-kubernetes-list-type: map`` list that repeat a key (the API server's "Duplicate value")."""
    errors: list[str] = []
    if isinstance(value, dict):
        for name, sub in (node.get("properties") or {}).items():
            if name in value:
                errors += _duplicate_keys(value[name], sub, f"{path}.{name}" if path else name)
    if isinstance(value, list) and node.get("x-kubernetes-list-type") == "map":
        keys = [tuple(item.get(k) for k in node["x-kubernetes-list-map-keys"]) for item in value]
        errors += [f"{path}[{i}]: Duplicate value: {key}" for i, key in enumerate(keys) if key in keys[:i]]
    return errors


def crd_errors(resource: dict[str, Any]) -> list[str]:
    """What the API server (structure + defaults + list keys + CEL) would say about ``resource``."""
    schema = crd.openapi_schema()
    obj = _default(copy.deepcopy(resource), schema)
    validator = jsonschema.Draft4Validator(structural_json_schema(schema))
    errors = [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]
    errors += _duplicate_keys(obj, schema)
    if not errors:
        errors = _cel_errors(obj, schema)
    return errors


def assert_refused(resource: dict[str, Any], reason: str, case: str) -> None:
    """``resource`` is refused by the operator's parser with a reason that starts with ``reason``, and by the CRD
    (structure and CEL rules, as the API server applies them)."""
    with pytest.raises(spec.SpecError) as info:
        spec.parse(identified(resource))
    assert any(r.startswith(reason) for r in info.value.reasons), info.value.reasons
    assert crd_errors(resource), f"the CRD accepts {case!r}"


def test_examples_validate_against_the_crd(example):
    assert crd_errors(example) == []
    parsed = spec.parse(example)
    # the operator's defaults are the CRD's defaults
    assert spec.validate(example) == _default(copy.deepcopy(example), crd.openapi_schema())
    assert parsed.data >= 1 and parsed.pods_per_group >= 1


def test_examples_cover_the_documented_shapes():
    by_name = {ex.rsplit("/", 1)[-1]: load_yaml(ex)[0] for ex in EXAMPLES}
    shapes = {name: spec.parse(doc) for name, doc in by_name.items()}
    assert shapes["single-gpu.yaml"].gpus_per_engine_pod == 1 and shapes["single-gpu.yaml"].data == 1
    assert shapes["tp8-one-node.yaml"].tensor == 8 and shapes["tp8-one-node.yaml"].pods_per_group == 1
    assert (shapes["tp2-dp4.yaml"].tensor, shapes["tp2-dp4.yaml"].data) == (2, 4)
    assert shapes["multi-node.yaml"].pods_per_group == 2
    assert shapes["rl-rollout-paused.yaml"].lifecycle == "Paused"
    pd = shapes["prefill-decode.yaml"]
    assert (pd.prefill_replicas, pd.decode_replicas, pd.data, pd.ranks_per_group) == (1, 2, 3, 1)
    moe = shapes["moe-expert-parallel.yaml"]
    assert (moe.gang, moe.tensor, moe.expert, moe.data_parallel_attention, moe.attention_tensor) == (True, 16, 16, 4, 4)
    # one pod per attention rank, of its 4 GPUs
    assert (moe.pods_per_group, moe.gpus_per_engine_pod) == (4, 4) and not shapes["multi-node.yaml"].gang


def _bad(mutate) -> dict[str, Any]:
    (doc,) = load_yaml(ROOT / "manifests" / "examples" / "tp2-dp4.yaml")
    doc = copy.deepcopy(doc)
    mutate(doc)
    return doc


BAD = {
    "tensor not fitting gpusPerPod": (lambda d: d["spec"]["parallelism"].update(tensor=3),
                                      "spec: parallelism.tensor * parallelism.pipeline must be a multiple or a "
                                      "divisor of engine.gpusPerPod"),
    "unknown lifecycle": (lambda d: d["spec"].update(lifecycle="Sleeping"),
                          "spec.lifecycle: unsupported value 'Sleeping'; must be one of: Running, Paused, "
                          "Suspended, Shutdown"),
    "negative data": (lambda d: d["spec"]["parallelism"].update(data=-1),
                      "spec.parallelism.data: must be at least 0, got -1"),
    "zero tensor": (lambda d: d["spec"]["parallelism"].update(tensor=0),
                    "spec.parallelism.tensor: must be at least 1, got 0"),
    "tensor as a string": (lambda d: d["spec"]["parallelism"].update(tensor="2"),
                           "spec.parallelism.tensor: must be an integer, got a string '2'"),
    "missing model": (lambda d: d["spec"].pop("model"), "spec.model: required field is missing"),
    "relative model path": (lambda d: d["spec"]["model"].update(path="models/x"),
                            "spec.model.path: must be an absolute path, got 'models/x'"),
    "model outside the volume": (lambda d: d["spec"]["model"].update(path="/data/x"),
                                 "spec.model: model.path must lie inside model.mountPath when model.volume or "
                                 "model.hub is set"),
    "neither path nor hub": (lambda d: d["spec"]["model"].pop("path"),
                             "spec.model: model needs path (a model directory in the pods) or hub"),
    "hub token without hub": (lambda d: d["spec"]["model"].update(hubTokenSecretRef={"name": "a", "key": "b"}),
                              "spec.model: model.hubTokenSecretRef applies to model.hub only"),
    "hub id that is a path": (lambda d: d["spec"]["model"].update(hub="/models/x"), "spec.model.hub: must match"),
    "hub fetched outside the volume": (lambda d: d["spec"]["model"].update(hub="org/x", path="/tmp/x"),
                                       "spec.model: model.path must lie inside model.mountPath"),
    "two volume sources": (lambda d: d["spec"]["model"]["volume"].update(hostPath={"path": "/x"}),
                           "spec.model: model.volume must name exactly one volume source"),
    "bad dtype": (lambda d: d["spec"]["model"].update(dtype="int8"),
                  "spec.model.dtype: unsupported value 'int8'"),
    "unknown field": (lambda d: d["spec"].update(replicas=3), "spec.replicas: unknown field"),
    "server on the coordinator port": (lambda d: d["spec"]["server"].update(port=5555),
                                       "spec: server.port must differ from the coordinator port 5555"),
    "memory fraction zero": (lambda d: d["spec"]["engine"]["kvCache"].update(memoryFraction=0),
                             "spec.engine.kvCache.memoryFraction: must be greater than 0, got 0"),
    "memory fraction above one": (lambda d: d["spec"]["engine"]["kvCache"].update(memoryFraction=1.5),
                                  "spec.engine.kvCache.memoryFraction: must be at most 1, got 1.5"),
    "api key ref without key": (lambda d: d["spec"]["server"].update(apiKeySecretRef={"name": "k"}),
                                "spec.server.apiKeySecretRef.key: required field is missing"),
    "drain timeout too long": (lambda d: d["spec"].update(drainTimeoutSeconds=99999),
                               "spec.drainTimeoutSeconds: must be at most 3600, got 99999"),
    "unknown pause mode": (lambda d: d["spec"].update(pauseMode="keep"),
                           "spec.pauseMode: unsupported value 'keep'; must be one of: Keep, Wait, Abort"),
    "unknown quantization": (lambda d: d["spec"]["engine"].update(quantization="int4"),
                             "spec.engine.quantization: unsupported value 'int4'; must be one of: none, fp8"),
    "unknown KV cache dtype": (lambda d: d["spec"]["engine"].update(kvCacheDtype="fp8_e5m2"),
                               "spec.engine.kvCacheDtype: unsupported value 'fp8_e5m2'; must be one of: auto, fp8"),
    "unknown routing": (lambda d: d["spec"]["coordinator"].update(routing="random"),
                        "spec.coordinator.routing: unsupported value 'random'"),
    "two adapters of one name": (lambda d: d["spec"].update(lora={"adapters": [{"name": "a", "path": "/x/a"},
                                                                               {"name": "a", "path": "/x/b"}]}),
                                 "spec.lora: lora.adapters must have distinct names"),
    "adapter name with =": (lambda d: d["spec"].update(lora={"adapters": [{"name": "a=b", "path": "/x/a"}]}),
                            "spec.lora.adapters[0].name: must match"),
    "relative adapter path": (lambda d: d["spec"].update(lora={"adapters": [{"name": "a", "path": "x/a"}]}),
                              "spec.lora.adapters[0].path: must be an absolute path, got 'x/a'"),
    "two adapter volume sources": (lambda d: d["spec"].update(lora={"volume": {"emptyDir": {}, "hostPath": {
        "path": "/x"}}}), "spec.lora: lora.volume must name exactly one volume source"),
    "adapter rank zero": (lambda d: d["spec"].update(lora={"maxLoraRank": 0}),
                          "spec.lora.maxLoraRank: must be at least 1, got 0"),
    "too many adapters": (lambda d: d["spec"].update(lora={"adapters": [{"name": f"a{i}", "path": "/x"}
                                                                        for i in range(257)]}),
                          "spec.lora.adapters: must have at most 256 items, got 257"),
    "attention ranks not dividing tensor": (
        lambda d: d["spec"]["engine"].update(parallelism={"tensor": 2, "expert": 2, "dataParallelAttention": 4}),
        "spec.engine.parallelism: engine.parallelism.dataParallelAttention must divide engine.parallelism.tensor"),
    "expert neither 1 nor tensor": (
        lambda d: d["spec"]["engine"].update(parallelism={"tensor": 4, "expert": 2}),
        "spec.engine.parallelism: engine.parallelism.expert must be 1 (experts sliced over the tensor ranks) or "
        "equal to engine.parallelism.tensor"),
    "attention ranks without expert parallelism": (
        lambda d: d["spec"]["engine"].update(parallelism={"tensor": 2, "dataParallelAttention": 2}),
        "spec.engine.parallelism: engine.parallelism.dataParallelAttention needs expert parallelism"),
    "zero expert": (lambda d: d["spec"]["engine"].update(parallelism={"expert": 0}),
                    "spec.engine.parallelism.expert: must be at least 1, got 0"),
    "negative pipeline": (lambda d: d["spec"]["engine"].update(parallelism={"pipeline": -1}),
                          "spec.engine.parallelism.pipeline: must be at least 1, got -1"),
    "unknown layout field": (lambda d: d["spec"]["engine"].update(parallelism={"context": 2}),
                             "spec.engine.parallelism.context: unknown field"),
    "group not fitting gpusPerPod": (
        lambda d: d["spec"]["engine"].update(gpusPerPod=8, parallelism={"tensor": 3, "pipeline": 2}),
        "spec: engine.parallelism.tensor * engine.parallelism.pipeline must be a multiple or a divisor of "
        "engine.gpusPerPod"),
    "attention rank wider than a pod": (
        lambda d: d["spec"]["engine"].update(gpusPerPod=4, parallelism={"tensor": 16, "expert": 16,
                                                                        "dataParallelAttention": 2}),
        "spec: engine.parallelism.tensor / engine.parallelism.dataParallelAttention must be at most "
        "engine.gpusPerPod"),
    "attention ranks with pipeline stages": (
        lambda d: d["spec"]["engine"].update(parallelism={"tensor": 2, "expert": 2, "dataParallelAttention": 2,
                                                          "pipeline": 2}),
        "spec.engine.parallelism: engine.parallelism.dataParallelAttention does not serve pipeline stages"),
    "two layouts that disagree": (
        lambda d: d["spec"]["engine"].update(parallelism={"tensor": 4}),  # spec.parallelism.tensor is 2
        "spec: parallelism.tensor is the older spelling of engine.parallelism.tensor"),
    "lookup window upside down": (
        lambda d: d["spec"]["engine"].update(speculative={"method": "ngram", "promptLookupMin": 4,
                                                          "promptLookupMax": 2}),
        "spec.engine.speculative: engine.speculative.promptLookupMin must not exceed"),
    "draft method without its model": (
        lambda d: d["spec"]["engine"].update(speculative={"method": "draft_model"}),
        "spec.engine.speculative: engine.speculative.model is required for method draft_model and eagle3"),
    "mtp with a model": (
        lambda d: d["spec"]["engine"].update(speculative={"method": "mtp", "model": "/models/draft"}),
        "spec.engine.speculative: engine.speculative.model must be unset for method mtp"),
    "fewer host adapters than device slots": (
        lambda d: d["spec"].update(lora={"maxLoras": 4, "maxCpuLoras": 2}),
        "spec.lora: lora.maxCpuLoras must be at least lora.maxLoras"),
    "two tenants of one name": (lambda d: d["spec"].update(tenants=[{"name": "a"}, {"name": "a"}]),
                                "spec.tenants[1]: duplicate value (name 'a')"),
    "name too long": (lambda d: d["metadata"].update(name="a" * 41),
                      "(root): metadata.name must be at most 40 characters"),
    "name starting with a digit": (lambda d: d["metadata"].update(name="7b-model"),
                                   "(root): metadata.name must start with a lower-case letter"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_resources_are_rejected_with_readable_reasons(case):
    mutate, reason = BAD[case]
    resource = _bad(mutate)
    with pytest.raises(spec.SpecError) as info:
        spec.parse(resource)
    assert any(r.startswith(reason) for r in info.value.reasons), info.value.reasons
    # the CRD (structure + CEL, as the API server applies it) rejects it too
    assert crd_errors(resource), f"the CRD accepts {case!r}"


def test_every_problem_is_reported_at_once():
    def mutate(d: dict[str, Any]) -> None:
        d["spec"]["lifecycle"] = "Nope"
        d["spec"]["parallelism"]["data"] = -2
        d["spec"]["extra"] = 1

    with pytest.raises(spec.SpecError) as info:
        spec.parse(_bad(mutate))
    assert len(info.value.reasons) == 3


def test_python_twins_agree_with_cel():
    """Each CEL rule and its Python twin give the same verdict on a spread of inputs."""
    import celpy

    env = celpy.Environment()
    samples: dict[str, list[dict[str, Any]]] = {
        "": [{"metadata": {"name": n}} for n in ("a", "a" * 40, "a" * 41, "7b", "x-1", "Bad")],
        "spec": [{"parallelism": {"tensor": t, "pipeline": p}, "engine": {"gpusPerPod": g},
                  "server": {"port": port, **({} if probe is None else {"probePort": probe})}}
                 for t in (1, 2, 3, 8, 16) for p in (1, 2) for g in (1, 4, 8) for port in (8000, 5555)
                 for probe in (None, 0, 8000, 8001, 5555)]
        + [{"parallelism": {"tensor": old, "pipeline": 1}, "server": {"port": 8000},
            "engine": {"gpusPerPod": g, **({} if t is None else {"parallelism": {"tensor": t, "pipeline": p}})}}
           for old in (1, 2, 4) for t in (None, 1, 2, 3, 4, 16) for p in (1, 2, 3) for g in (1, 4, 8)]
        + [{"parallelism": {"tensor": 1, "pipeline": 1}, "server": {"port": 8000},
            "engine": {"gpusPerPod": g, "parallelism": {"tensor": t, "pipeline": 1, "dataParallelAttention": d}}}
           for t in (1, 2, 4, 8, 16) for d in (1, 2, 4) for g in (1, 2, 4, 8)],
        "spec.engine": [{"kvCache": {"prefixCaching": caching}, **({"kvOffloadingSize": 2} if tier else {})}
                        for caching in (True, False) for tier in (False, True)],
        "spec.engine.parallelism": [{"tensor": t, "pipeline": p, "expert": e, "dataParallelAttention": d}
                                    for t in (1, 2, 3, 4, 8) for e in (1, 2, 4, 8) for d in (1, 2, 3, 4)
                                    for p in (1, 2)],
        "spec.model": [{**({"path": path} if path is not None else {}), "mountPath": mount,
                        **({"volume": vol} if vol is not None else {}), **({"hub": hub} if hub else {}),
                        **({"hubTokenSecretRef": {"name": "a", "key": "b"}} if token else {})}
                       for path in ("/models/x", "/models", "/modelsx/y", "/data/x", None)
                       for mount in ("/models", "/")
                       for vol in (None, {"emptyDir": {}}, {"emptyDir": {}, "hostPath": {"path": "/"}})
                       for hub in (None, "org/name") for token in (False, True)],
        "spec.lora": [{**({"volume": vol} if vol is not None else {}),
                       "adapters": [{"name": name, "path": "/a"} for name in names]}
                      for vol in (None, {"emptyDir": {}}, {"emptyDir": {}, "hostPath": {"path": "/"}})
                      for names in ((), ("a",), ("a", "b"), ("a", "a"), ("a", "b", "a"))]
        + [{"adapters": [], "maxLoras": slots, **({} if host is None else {"maxCpuLoras": host})}
           for slots in (1, 4) for host in (None, 1, 4, 8)],
        "spec.engine.speculative": [{"method": method, "promptLookupMin": low, "promptLookupMax": high,
                                     **({} if model is None else {"model": model})}
                                    for method in ("ngram", "draft_model", "mtp", "eagle3")
                                    for low, high in ((1, 3), (3, 3), (4, 2)) for model in (None, "/models/d")],
    }
    for where, rule, _, check in crd.CEL_RULES:
        program = env.program(env.compile(rule))
        for sample in samples[where]:
            assert bool(program.evaluate({"self": celpy.json_to_cel(sample)})) == check(sample), (rule, sample)
