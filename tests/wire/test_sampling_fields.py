"""The table of sampling parameters (``wire/sampling_fields.py``) against what reads it: ``SamplingParams`` declares
exactly its rows with their defaults and refuses what their ranges refuse, the HTTP request models declare the copied
rows with their ranges, the translation copies them, the generation_config keys and the sampling state's vectors come
from it. ``tests/test_layout.py`` holds that no other module lists the parameters."""

from __future__ import annotations

import json

import pydantic
import pytest
import torch

from megatron_serve.engine.sampling.logprob_parity import ParityChecker
from megatron_serve.engine.sampling.sampling_state import SamplingState
from megatron_serve.generation_config import GenerationDefaults
from megatron_serve.server.models import ChatCompletionRequest, CompletionRequest
from megatron_serve.server.rl.sglang_generate import SglangSamplingParams
from megatron_serve.server.rl.vllm_sampling import VllmSamplingParams, vllm_sampling
from megatron_serve.server.translate import sampling_params as translated
from megatron_serve.wire.request import FinalRecord, RequestStatus
from megatron_serve.wire.sampling_fields import (
    BY_NAME,
    COPIED,
    FIELDS,
    FILTERS,
    GENERATION_CONFIG_KEYS,
    SAMPLER_INPUTS,
    Bounds,
    SamplingField,
)
from megatron_serve.wire.sampling_params import SamplingParams


def test_sampling_params_declares_exactly_the_rows_in_order_with_their_defaults():
    assert [row.name for row in FIELDS] == list(SamplingParams.__struct_fields__)
    built = SamplingParams()
    assert {row.name: row.default for row in FIELDS} == {name: getattr(built, name) for name in built.__struct_fields__}


def _outside(bounds: Bounds, kind: type) -> list[object]:
    """Values just outside ``bounds`` (of a number field of ``kind``)."""
    values: list[object] = []
    if bounds.minimum is not None:
        values.append(kind(bounds.minimum - 1))
    if bounds.above is not None:
        values.append(kind(bounds.above))
    if bounds.maximum is not None:
        values.append(kind(bounds.maximum + 1))
    return values


@pytest.mark.parametrize("row", [row for row in FIELDS if row.bounds is not None], ids=lambda row: row.name)
def test_sampling_params_refuses_what_a_rows_bounds_refuse_naming_the_field(row):
    outside = _outside(row.bounds, row.kind)
    assert outside
    for value in outside:  # as the wire reads them (the Python API also takes vLLM's top_k=-1 for 0)
        with pytest.raises(ValueError, match=f"^{row.name} "):
            SamplingParams.from_dict({row.name: value})
    if row.bounds.minimum is not None and row.bounds.above is None:  # the bound itself is accepted
        SamplingParams.from_dict({row.name: row.kind(row.bounds.minimum)})


def _inside(bounds: Bounds | None, value: float) -> bool:
    return bounds is None or ((bounds.minimum is None or value >= bounds.minimum)
                              and (bounds.maximum is None or value <= bounds.maximum)
                              and (bounds.above is None or value > bounds.above))


def _set(row: SamplingField) -> object:
    """A request's value of ``row`` off its neutral default, inside both its request's range and its own: the tests
    below build every request from the table, so a new row is checked by them with no edit here."""
    if row.kind is bool:
        return not row.default
    if row.kind is str:
        return "s"
    if row.kind is list:  # token ids
        return [2, 3]
    for candidate in (2, 0.5):
        value = row.kind(candidate)
        if value != row.default and _inside(row.request_bounds, value) and _inside(row.bounds, value):
            return value
    raise AssertionError(f"no value off the default inside the bounds of {row.name}")


def _engine(row: SamplingField) -> object:
    """:func:`_set`'s value as ``SamplingParams`` holds it."""
    value = _set(row)
    return value if row.from_http is None else row.from_http(value)


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_the_request_models_declare_the_copied_rows_with_their_ranges(model):
    base = {"model": "m", "prompt": "x"} if model is CompletionRequest else {"model": "m", "messages": [
        {"role": "user", "content": "x"}]}
    for row in COPIED:
        assert row.http in model.model_fields, row.http
        assert model.model_fields[row.http].description, row.http
        bounds = row.request_bounds
        if bounds is None or row.kind is str:
            continue
        for value in _outside(bounds, row.kind):
            with pytest.raises(pydantic.ValidationError) as refused:
                model.model_validate({**base, row.http: value})
            assert refused.value.errors()[0]["loc"][0] == row.http


def test_the_vllm_and_sglang_bodies_take_the_copied_rows_by_their_names():
    for row in COPIED:
        if row.vllm is not None:
            assert row.vllm in VllmSamplingParams.model_fields
        if row.sglang is not None:
            assert row.sglang in SglangSamplingParams.model_fields
    given = SamplingParams(**{row.name: _engine(row) for row in COPIED if row.vllm})
    back = vllm_sampling(given, 1)
    assert {row.vllm: back[row.vllm] for row in COPIED if row.vllm} == {
        row.vllm: getattr(given, row.name) for row in COPIED if row.vllm}


def test_the_translation_copies_every_copied_row_and_leaves_out_what_a_request_does_not_set():
    request = CompletionRequest(model="m", prompt="x", **{row.http: _set(row) for row in COPIED})
    params = translated(request, max_tokens=4, logprobs=False, top_logprobs=0, choice=0,
                        defaults=GenerationDefaults({"min_p": 0.5, "top_k": 20}))
    assert {row.name: getattr(params, row.name) for row in COPIED} == {row.name: _engine(row) for row in COPIED}
    silent = translated(CompletionRequest(model="m", prompt="x"), max_tokens=4, logprobs=False, top_logprobs=0,
                        choice=0, defaults=GenerationDefaults({"min_p": 0.5, "top_k": 20}))
    assert {row.name: getattr(silent, row.name) for row in COPIED} == {
        row.name: {"min_p": 0.5, "top_k": 20}.get(row.name, row.default) for row in COPIED}


def test_the_translation_reads_vllms_off_top_k_and_any_64_bit_seed():
    request = CompletionRequest(model="m", prompt="x", top_k=-1, seed=-1)
    params = translated(request, max_tokens=4, logprobs=False, top_logprobs=0, choice=0,
                        defaults=GenerationDefaults({"top_k": 20}))
    assert (params.top_k, params.seed) == (0, 2**63 - 1)


def test_generation_config_keys_are_the_rows_that_name_one(tmp_path):
    named = [BY_NAME[name] for name in GENERATION_CONFIG_KEYS.values()]
    config = {row.generation_config: _engine(row) for row in named}
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "bos_token_id": 1}))
    defaults = GenerationDefaults.load("auto", tmp_path)
    assert dict(defaults.values) == {row.name: _engine(row) for row in named}


def test_the_sampling_state_keeps_one_vector_per_sampler_input_written_from_the_request():
    state = SamplingState(16, torch.device("cpu"), capacity=2)
    params = SamplingParams(**{row.name: _engine(row) for row in SAMPLER_INPUTS})
    state.add("a", params, seed=1, prompt_tokens=[1], output_tokens=[], stop_token_ids=[])
    rows = state.rows(["a"], [0], [0])
    for row in SAMPLER_INPUTS:
        assert state.vector(row.sampler)[0].item() == pytest.approx(row.default), row.sampler  # the neutral slot
        assert state.vector(row.sampler)[rows.slot].item() == pytest.approx(getattr(params, row.name)), row.sampler
    assert rows.inputs == {row.sampler for row in SAMPLER_INPUTS}


def test_a_step_uses_each_sampler_input_exactly_when_some_row_sets_it():
    """The sampler's fast paths ask ``StepRows.uses(input)`` of the table's inputs, no flag kept per filter: each input
    is used by a step whose one request sets it alone, and by no step of a request at the neutral defaults."""
    for row in SAMPLER_INPUTS:
        state = SamplingState(16, torch.device("cpu"), capacity=2)
        state.add("a", SamplingParams(**{row.name: _engine(row)}), seed=1, prompt_tokens=[1], output_tokens=[],
                  stop_token_ids=[])
        state.add("b", SamplingParams(), seed=1, prompt_tokens=[1], output_tokens=[], stop_token_ids=[])
        used = state.rows(["a"], [0], [0])
        assert [r.sampler for r in SAMPLER_INPUTS if used.uses(r.sampler)] == [row.sampler], row.name
        neutral = state.rows(["b"], [0], [0])
        assert not any(neutral.uses(r.sampler) for r in SAMPLER_INPUTS), row.name
    with pytest.raises(KeyError, match="no_such_input"):
        neutral.uses("no_such_input")


def test_a_greedy_request_uses_no_filter_but_keeps_its_penalties():
    state = SamplingState(16, torch.device("cpu"), capacity=2)
    state.add("g", SamplingParams(temperature=0.0, top_k=3, min_p=0.25, repetition_penalty=1.5), seed=1,
              prompt_tokens=[1], output_tokens=[], stop_token_ids=[])
    rows = state.rows(["g"], [0], [0])
    assert rows.inputs == {"repetition"} and not rows.uses("temperature") and not rows.uses("min_p")


def test_the_parity_checker_scores_with_the_originals_filters():
    checker = ParityChecker(1.0, 64, "processed_logprobs")
    original = SamplingParams(**{row.name: _engine(row) for row in FILTERS}, return_log_probs=True)
    from megatron_serve.engine.sampling.logprob_parity import Reported  # noqa: PLC0415

    reported = Reported([1, 2], original, tokens=[3], log_probs=[-0.5], epochs={0})
    request = checker.scoring_request(reported, FinalRecord(request_id="r", status=RequestStatus.COMPLETED), 0)
    assert {row.name: getattr(request.sampling_params, row.name) for row in FILTERS} == {
        row.name: getattr(original, row.name) for row in FILTERS}
