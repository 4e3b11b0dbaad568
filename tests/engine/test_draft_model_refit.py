"""Issue 39, item 5: the drafter is refit in the policy's transaction, or proposes nothing under the new epoch.

Policy A (seed 0) serves with drafter D (seed 2, the policy's shapes); a refit under load brings policy B
(seed 1) and, as ``drafter.*`` tensors in the same refit, B's weights as the new drafter. Afterwards the
tokens are B's (== a fresh engine on B) and every draft is accepted (the drafter is now the policy), where D
had its drafts rejected (the control). A refit of the policy alone leaves D stale: not one draft
token is proposed after it, and the tokens are still B's.
"""

from __future__ import annotations

import pytest

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine
from megatron_serve.model.loader import iterate_checkpoint
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.weights.sources import TensorSource

PROMPTS = [[7, 42, 99, 3, 250, 18, 77], [300, 301], list(range(10, 40))]
COUNT = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-refit")
    return {name: str(make_tiny_model(root / name, seed=seed)) for name, seed in
            (("a", 0), ("b", 1), ("d", 2), ("e", 3))}


def engine_on(model_dir: str, draft_dir: str | None) -> DynamicInferenceEngine:
    speculative = None if draft_dir is None else {"method": "draft_model", "model": draft_dir,
                                                  "num_speculative_tokens": 3, "adaptive": False}
    return DynamicInferenceEngine.from_model_dir(
        model_dir, InferenceConfig(device="cpu", dtype="float32", speculative=speculative))


def add(engine: DynamicInferenceEngine, tag: str) -> list[DynamicInferenceRequest]:
    requests = [DynamicInferenceRequest(f"{tag}{i}", None, prompt, SamplingParams(
        temperature=0.0, num_tokens_to_generate=COUNT, ignore_eos=True)) for i, prompt in enumerate(PROMPTS)]
    for request in requests:
        engine.add_request(request)
    return requests


def drain(engine: DynamicInferenceEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def counts(engine: DynamicInferenceEngine) -> tuple[int, int]:
    counters = engine.stats.counters
    return counters.get("spec_decode_num_draft_tokens", 0), counters.get("spec_decode_num_accepted_tokens", 0)


def tensors(model_dir: str, prefix: str = "") -> list:
    return [(prefix + name, tensor[:]) for name, tensor in iterate_checkpoint(model_dir)]  # slices read whole


@pytest.fixture(scope="module")
def expected_b(models):
    engine = engine_on(models["b"], None)
    requests = add(engine, "b")
    drain(engine)
    engine.shutdown()
    return [request.generated_tokens for request in requests]


def refit_under_load(models, named: list) -> tuple[DynamicInferenceEngine, list[DynamicInferenceRequest],
                                                     tuple[int, int], tuple[int, int]]:
    """Serve A with drafter D, refit with ``named`` after 3 steps of requests in flight, finish them; returns
    the engine, the in-flight requests, and the counters before the refit and after the in-flight ones ended."""
    engine = engine_on(models["a"], models["d"])
    in_flight = add(engine, "old")
    for _ in range(3):
        engine.step()
    before = counts(engine)
    assert before[0] > 0
    assert engine.memory.refit(TensorSource.of(named), epoch=5)["epoch"] == 5
    drain(engine)
    for request in in_flight:
        assert request.policy_epochs[0] == 0 and request.policy_epochs[-1] == 5
    return engine, in_flight, before, counts(engine)


def test_a_refit_carrying_the_drafter_switches_policy_and_drafter_together(models, expected_b):
    control = engine_on(models["a"], models["d"])
    add(control, "c")
    drain(control)
    drafts, accepted = counts(control)
    control.shutdown()
    assert accepted < drafts  # D is not A: its drafts are rejected (random tiny models rarely agree)

    engine, _, _, after_load = refit_under_load(models, tensors(models["b"]) + tensors(models["b"], "drafter."))
    assert engine.speculator.proposer.draft_epoch == 5 and not engine.speculator.proposer.stale
    fresh = add(engine, "new")
    drain(engine)
    drafts, accepted = (now - then for now, then in zip(counts(engine), after_load))
    assert [request.generated_tokens for request in fresh] == expected_b
    assert {e for request in fresh for e in request.policy_epochs} == {5}
    assert drafts > 0 and accepted == drafts  # the new drafter (== the new policy) proposes, and is always right
    engine.shutdown()


def test_a_refit_of_the_policy_alone_turns_speculation_off(models, expected_b):
    engine, _, before, after_load = refit_under_load(models, tensors(models["b"]))
    assert engine.speculator.proposer.stale
    assert after_load == before  # no draft under epoch 5, also for the requests that were in flight
    fresh = add(engine, "new")
    drain(engine)
    assert [request.generated_tokens for request in fresh] == expected_b
    assert counts(engine) == before
    engine.shutdown()


def test_a_later_refit_of_another_drafter_brings_speculation_back(models, expected_b):
    """Drafter E (not the policy) refit at the policy's epoch: it proposes again, with E's acceptance, not B's."""
    engine, _, _, after_load = refit_under_load(models, tensors(models["b"]) + tensors(models["e"], "drafter."))
    fresh = add(engine, "new")
    drain(engine)
    drafts, accepted = (now - then for now, then in zip(counts(engine), after_load))
    assert [request.generated_tokens for request in fresh] == expected_b
    assert drafts > 0 and accepted < drafts
    engine.shutdown()


def test_drafter_tensors_that_do_not_fit_are_refused_before_any_weight_changes(models):
    engine = engine_on(models["a"], models["d"])
    wide = make_tiny_model(f"{models['d']}-wide", seed=4, hidden_size=96)
    with pytest.raises(ValueError, match="drafter tensors do not fit the drafter"):
        engine.memory.refit(TensorSource.of(tensors(models["b"]) + tensors(str(wide), "drafter.")), epoch=5)
    assert engine.epoch == 0 and not engine.speculator.proposer.stale
    engine.shutdown()
    plain = engine_on(models["a"], None)
    with pytest.raises(ValueError, match="runs no drafter to refit"):
        plain.memory.refit(TensorSource.of(tensors(models["b"]) + tensors(models["b"], "drafter.")), epoch=5)
    assert plain.epoch == 0
    plain.shutdown()
