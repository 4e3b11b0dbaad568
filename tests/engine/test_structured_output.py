"""Structured outputs in the engine: every constrained output is in its language, free rows are untouched,
and the grammar state survives preemption and a move to another engine (rebuilt from the tokens).

Schema validity over many seeds is checked through the HTTP API (``tests/server/test_openai_surface.py``)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, RequestStatus, SamplingParams
from megatron_serve.wire.sampling_params import StructuredOutputsParams

from ..prompts import PROMPTS, run_requests, run_steps, run_to_end

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
GBNF = 'root ::= "yes" | "no" | "maybe " digit\ndigit ::= [0-9]'


def constrained(**spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, num_tokens_to_generate=120, seed=spec.pop("seed", 0),
                          structured_outputs=StructuredOutputsParams(**spec))


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=16))


def test_each_kind_of_constraint_mixes_with_free_requests_in_one_batch(llm):
    free = SamplingParams(temperature=0.0, num_tokens_to_generate=24, ignore_eos=True)
    reference = [o.generated_tokens for o in llm.generate(PROMPTS[:3], free)]
    outs = run_requests(llm.engine, [
        (PROMPTS[0], free),
        (PROMPTS[1], constrained(choice=["red", "green", "blue sky"])),
        (PROMPTS[1], free),
        (PROMPTS[2], constrained(regex=r"[A-Z][a-z]{2,5}-\d{3}")),
        (PROMPTS[2], free),
        (PROMPTS[3], constrained(grammar=GBNF, seed=4)),
        (PROMPTS[4], constrained(json_object=True)),
    ])
    assert [outs[i].generated_tokens for i in (0, 2, 4)] == reference
    texts = [llm.tokenizer.decode(o.generated_tokens) for o in outs]  # the engine deals in token ids only
    assert texts[1] in ("red", "green", "blue sky")
    assert re.fullmatch(r"[A-Z][a-z]{2,5}-\d{3}", texts[3])
    assert re.fullmatch(r"yes|no|maybe \d", texts[5])
    # Any JSON object: its keys are unbounded strings, which a random model rarely closes, so it may run out
    # of tokens; what it wrote is still the start of an object.
    text = texts[6]
    assert isinstance(json.loads(text), dict) if outs[6].finish_reason.value == "stop" else text.startswith('{"')


def test_grammar_state_survives_preemption(tiny_llama, llm):
    jobs = [(p, constrained(json=SCHEMA, seed=i)) for i, p in enumerate(PROMPTS)]
    reference = [o.generated_tokens for o in run_requests(llm.engine, jobs)]
    tight = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=4, num_kv_blocks=64, max_batch_tokens=64))
    outs = run_requests(tight.engine, [(p, constrained(json=SCHEMA, seed=i)) for i, p in enumerate(PROMPTS)])
    assert all(o.status is RequestStatus.COMPLETED for o in outs), [o.error for o in outs]
    assert sum(1 for o in outs for e in o.events if e.type.value == "PREEMPT") > 0
    assert [o.generated_tokens for o in outs] == reference


def test_grammar_state_is_rebuilt_on_another_engine(tiny_llama, llm):
    jobs = [(p, constrained(json=SCHEMA, seed=i)) for i, p in enumerate(PROMPTS[:4])]
    reference = [o.generated_tokens for o in run_requests(llm.engine, jobs)]
    first, second = MegatronLLM(tiny_llama).engine, MegatronLLM(tiny_llama).engine
    requests = [DynamicInferenceRequest(str(i), p, first.tokenizer.encode(p), sp) for i, (p, sp) in enumerate(jobs)]
    run_steps(first, requests, 8)
    handed = first.take_unfinished_requests()
    assert handed and all(r.generated_tokens for r in handed)
    run_to_end(second, handed)
    assert [r.generated_tokens for r in requests] == reference
    for request in requests:
        jsonschema.validate(json.loads(second.tokenizer.decode(request.generated_tokens)), SCHEMA)


def test_a_bad_grammar_fails_its_request_alone(llm):
    outs = run_requests(llm.engine, [(PROMPTS[0], constrained(regex="a(")),
                            (PROMPTS[0], SamplingParams(temperature=0.0, num_tokens_to_generate=4))])
    assert outs[0].status is RequestStatus.FAILED and "structured_outputs" in outs[0].error
    assert "regex" in outs[0].error or "unclosed" in outs[0].error
    assert outs[1].status is RequestStatus.COMPLETED


@pytest.mark.parametrize("extra,fits", [(None, False), (True, True)])
def test_a_schema_without_additional_properties_is_closed_as_vllm_reads_it(llm, extra, fits):
    """A schema that does not say ``additionalProperties`` admits no other key (vLLM's default backend is strict:
    LangChain's structured output and forced tools send such schemas, and a small model added keys forever);
    ``"additionalProperties": true`` keeps them open. The text is fed to the engine's grammar as if generated."""
    schema = {"type": "object", "properties": {"city": {"type": "object", "properties": {"name": {"type": "string"}}}},
              "required": ["city"]}
    if extra is not None:
        schema["additionalProperties"] = schema["properties"]["city"]["additionalProperties"] = extra
    structured = llm.engine.worker.structured
    for text in ('{"city": {"name": "Paris"}, "country": "FR"}', '{"city": {"name": "Paris", "zip": "75"}}'):
        problem = structured.add("r", StructuredOutputsParams(json=schema), llm.tokenizer.encode(text))
        structured.remove("r")
        assert (problem is None) is fits, (text, problem)
    assert structured.add("r", StructuredOutputsParams(json=schema), llm.tokenizer.encode('{"city": {"name": "P"}}')) \
        is None
    structured.remove("r")
