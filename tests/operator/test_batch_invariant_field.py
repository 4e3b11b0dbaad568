"""``spec.engine.batchInvariant`` reaches the engine command as ``--batch-invariant``, and only when on."""

from __future__ import annotations

import pytest

from megatron_operator import spec
from megatron_operator.render import render

from .helpers import ROOT, load_yaml
from .test_operator_render import CONFIG, _containers, _parser_for, by_key, identified


@pytest.mark.parametrize("batch_invariant", [None, False, True])
def test_batch_invariant_reaches_the_engine_command(batch_invariant):
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "tp2-dp4.yaml")
    if batch_invariant is not None:
        resource["spec"]["engine"]["batchInvariant"] = batch_invariant
    sts = by_key(render(identified(resource), CONFIG))[("StatefulSet", "qwen-14b-engine-0")]
    (engine,) = _containers(sts)
    command, *args = engine["args"]
    # Off adds no flag, so pod templates rendered before the field existed still match.
    assert ("--batch-invariant" in args) is (batch_invariant is True)
    parsed, _ = _parser_for(command).parse_known_args(args)
    assert parsed.batch_invariant is (True if batch_invariant else None)
    assert spec.parse(identified(resource)).batch_invariant is bool(batch_invariant)


def test_a_non_boolean_batch_invariant_is_rejected():
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "tp2-dp4.yaml")
    resource["spec"]["engine"]["batchInvariant"] = "yes"
    with pytest.raises(spec.SpecError, match="batchInvariant"):
        spec.parse(identified(resource))
