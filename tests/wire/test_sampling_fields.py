"""The table of sampling parameters (``wire/sampling_fields.py``) against what reads it: ``SamplingParams`` declares
exactly its rows with their defaults and refuses what their ranges refuse, the HTTP request models declare the copied
rows with their ranges, the translation copies them, the generation_config keys and the sampling state's vectors come
from it. ``tests/test_layout.py`` holds that no other module lists the parameters."""

from __future__ import annotations

import pydantic
import pytest
import torch

from megatron_serve.engine.logprob_parity import ParityChecker
from megatron_serve.engine.sampling_state import SamplingState
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
    given = SamplingParams(temperature=0.5, top_k=7, min_p=0.25, seed=3, presence_penalty=0.5)
    back = vllm_sampling(given, 1)
    assert {row.vllm: back[row.vllm] for row in COPIED if row.vllm} == {
        row.vllm: getattr(given, row.name) for row in COPIED if row.vllm}


def test_the_translation_copies_every_copied_row_and_leaves_out_what_a_request_does_not_set():
    request = CompletionRequest(model="m", prompt="x", temperature=0.5, top_k=-1, top_p=0.9, seed=-1, min_p=0.25,
                                presence_penalty=1, frequency_penalty=-0.5, repetition_penalty=1.5, min_tokens=2,
                                ignore_eos=True, priority=-3, cache_salt="s", skip_special_tokens=False,
                                include_stop_str_in_output=True, return_routing_indices=True)
    params = translated(request, max_tokens=4, logprobs=False, top_logprobs=0, choice=0,
                        defaults=GenerationDefaults({"min_p": 0.5, "top_k": 20}))
    assert {row.name: getattr(params, row.name) for row in COPIED} == {
        "temperature": 0.5, "top_k": 0, "top_p": 0.9, "seed": 2**63 - 1, "min_p": 0.25, "presence_penalty": 1.0,
        "frequency_penalty": -0.5, "repetition_penalty": 1.5, "min_tokens": 2, "ignore_eos": True, "priority": -3,
        "cache_salt": "s", "skip_special_tokens": False, "include_stop_str_in_output": True,
        "return_routing_indices": True}
    silent = translated(CompletionRequest(model="m", prompt="x"), max_tokens=4, logprobs=False, top_logprobs=0,
                        choice=0, defaults=GenerationDefaults({"min_p": 0.5, "top_k": 20}))
    assert {row.name: getattr(silent, row.name) for row in COPIED} == {
        row.name: {"min_p": 0.5, "top_k": 20}.get(row.name, row.default) for row in COPIED}


def test_generation_config_keys_are_the_rows_that_name_one(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.1, '
                                                     '"repetition_penalty": 1.1, "max_new_tokens": 64, "do_sample": true}')
    defaults = GenerationDefaults.load("auto", tmp_path)
    assert dict(defaults.values) == {GENERATION_CONFIG_KEYS[key]: value for key, value in (
        ("temperature", 0.6), ("top_k", 20), ("top_p", 0.95), ("min_p", 0.1), ("repetition_penalty", 1.1),
        ("max_new_tokens", 64))}
    assert set(GENERATION_CONFIG_KEYS.values()) <= set(BY_NAME)


def test_the_sampling_state_keeps_one_vector_per_sampler_input_written_from_the_request():
    state = SamplingState(16, torch.device("cpu"), capacity=2)
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.25, presence_penalty=0.5,
                            frequency_penalty=0.25, repetition_penalty=1.5, min_tokens=2)
    state.add("a", params, seed=1, prompt_tokens=[1], output_tokens=[], stop_token_ids=[])
    rows = state.rows(["a"], [0], [0])
    for row in SAMPLER_INPUTS:
        assert state.vector(row.sampler)[0].item() == pytest.approx(row.default), row.sampler  # the neutral slot
        assert state.vector(row.sampler)[rows.slot].item() == pytest.approx(getattr(params, row.name)), row.sampler
    assert rows.inputs == {row.sampler for row in SAMPLER_INPUTS}


def test_a_greedy_request_uses_no_filter_but_keeps_its_penalties():
    state = SamplingState(16, torch.device("cpu"), capacity=2)
    state.add("g", SamplingParams(temperature=0.0, top_k=3, min_p=0.25, repetition_penalty=1.5), seed=1,
              prompt_tokens=[1], output_tokens=[], stop_token_ids=[])
    rows = state.rows(["g"], [0], [0])
    assert rows.inputs == {"repetition"} and rows.unit_temperature and not rows.any_min_p and rows.any_repetition


def test_the_parity_checker_scores_with_the_originals_filters():
    checker = ParityChecker(1.0, 64, "processed_logprobs")
    original = SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.25, return_log_probs=True)
    from megatron_serve.engine.logprob_parity import Reported  # noqa: PLC0415

    reported = Reported([1, 2], original, tokens=[3], log_probs=[-0.5], epochs={0})
    request = checker.scoring_request(reported, FinalRecord(request_id="r", status=RequestStatus.COMPLETED), 0)
    assert {row.name: getattr(request.sampling_params, row.name) for row in FILTERS} == {
        row.name: getattr(original, row.name) for row in FILTERS}
