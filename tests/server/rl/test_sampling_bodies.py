"""The frameworks' sampling bodies are built from the table of sampling parameters (``wire/sampling_fields.py``):
every row with a vLLM or SGLang name and an HTTP field is a field of that framework's body, of the row's body type,
and a row added to the table reaches the bodies with nothing else edited. Pure: no server, no model."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from megatron_serve.server.rl import sampling_bodies
from megatron_serve.server.rl.sampling_bodies import completions_names, framework_rows, sampling_body, vllm_names
from megatron_serve.server.rl.sglang_generate import OWN, SglangSamplingParams
from megatron_serve.server.rl.trl_generate import TRL_DEFAULTS, TrlGenerateRequest
from megatron_serve.server.rl.vllm_sampling import NO_EFFECT, VllmSamplingParams
from megatron_serve.wire.sampling_fields import FIELDS, SamplingField


@pytest.mark.parametrize("framework, body, own", [("vllm", VllmSamplingParams, NO_EFFECT),
                                                   ("sglang", SglangSamplingParams, OWN)])
def test_each_row_a_framework_names_is_a_field_of_its_body_of_the_rows_type(framework, body, own):
    rows = framework_rows(framework)
    assert set(body.model_fields) == set(rows) | set(own)
    for name, row in rows.items():
        assert body.model_fields[name].annotation == (row.body_type | None), name
    # the rows whose names differ are passed on under their HTTP field
    assert completions_names("sglang")["max_new_tokens"] == "max_tokens"
    assert completions_names("vllm") == {}  # vLLM's names are the completions fields'


def test_a_row_added_to_the_table_is_a_field_of_the_bodies_with_nothing_else_edited(monkeypatch):
    row = SamplingField("bad_words", object, None, http="bad_words", vllm="bad_words", sglang="banned_words",
                        body=list[str])
    monkeypatch.setattr(sampling_bodies, "FIELDS", (*FIELDS, row))
    vllm = sampling_body("V", "vllm", "a vLLM body")
    sglang = sampling_body("S", "sglang", "an SGLang body")
    assert vllm(bad_words=["x"]).bad_words == ["x"]
    assert sglang(banned_words=["x"]).banned_words == ["x"]
    assert completions_names("sglang")["banned_words"] == "bad_words"
    with pytest.raises(ValidationError, match="bad_words"):
        vllm(bad_words="x")  # the row's body type, strictly


def test_trls_body_takes_trls_defaults_and_refuses_null_where_trl_does():
    body = TrlGenerateRequest(prompts=["hi"])
    assert {name: getattr(body, name) for name in TRL_DEFAULTS} == TRL_DEFAULTS
    assert TrlGenerateRequest(prompts=["hi"], logprobs=None).logprobs is None  # null: no log probs, as TRL's
    with pytest.raises(ValidationError, match="n"):
        TrlGenerateRequest(prompts=["hi"], n=None)


def test_a_route_naming_what_the_table_lacks_is_refused_at_import_naming_it():
    with pytest.raises(ValueError, match="top_q is no vllm name of the sampling table"):
        sampling_body("T", "vllm", "a body", defaults={"top_q": 1.0})


def test_sglangs_names_become_vllms_by_the_table_and_vllms_own_name_wins():
    assert vllm_names({"max_new_tokens": 5, "sampling_seed": 7, "no_stop_trim": True, "top_k": -1}) == {
        "max_tokens": 5, "seed": 7, "include_stop_str_in_output": True, "top_k": -1}
    assert vllm_names({"max_tokens": 3, "max_new_tokens": 5}) == {"max_tokens": 3}
