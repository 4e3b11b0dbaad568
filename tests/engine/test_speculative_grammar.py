"""Speculation with grammars: drafts are cut where the grammar refuses them, every verified position samples under
the mask of its own grammar state, and the output is the plain engine's, token for token and log prob for log prob.

A JSON array of repeated enum strings or small objects is mostly forced text (quotes, keys, commas) that prompt
lookup finds again in the request's own output, so drafts of grammar rows are accepted often (measured: 223 of
237 greedy, 171 of 210 sampled), and a rejected one ends the run at a position the grammar constrains.
"""

from __future__ import annotations

import random
import re

import pytest

from megatron_serve import InferenceConfig, SamplingParams
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.engine.speculative.decoder import Speculator
from megatron_serve.engine.sampling.structured_output import StructuredOutputs
from megatron_serve.wire.request import FinishReason
from megatron_serve.wire.sampling_params import StructuredOutputsParams

from .test_speculative import engine_for, looping, outputs, repetitive_prompts, run

ENUMS = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma delta"]}, "minItems": 6, "maxItems": 12}
OBJECTS = {"type": "array", "items": {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
                                      "properties": {"ok": {"type": "boolean"},
                                                     "n": {"type": "integer", "minimum": 0, "maximum": 9}}},
           "minItems": 4, "maxItems": 8}


def constrained(schema: dict, temperature: float, seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, num_tokens_to_generate=120, return_log_probs=True,
                          top_n_logprobs=2, structured_outputs=StructuredOutputsParams(json=schema), **kwargs)


@pytest.fixture(scope="module")
def invariant_pair(tiny_llama):
    """Batch-invariant engines without and with n-gram speculation (K pinned to 4)."""
    return engine_for(tiny_llama, False, batch_invariant=True), engine_for(tiny_llama, True, batch_invariant=True)


def accepted(engine: DynamicInferenceEngine) -> int:
    return engine.stats.counters["spec_decode_num_accepted_tokens"]


@pytest.mark.parametrize("schema", [ENUMS, OBJECTS], ids=["enums", "objects"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_grammar_requests_speculate_and_emit_the_plain_engines_tokens(invariant_pair, schema, temperature):
    plain, spec = invariant_pair
    prompts = repetitive_prompts(31, 3)
    params = [constrained(schema, temperature, seed) for seed in (3, 4, 5)]
    before = accepted(spec)
    got = run(spec, prompts, params)  # grammar requests only: the accepted drafts are theirs
    assert outputs(got) == outputs(run(plain, prompts, params))
    assert accepted(spec) - before > 20
    assert any(r.finish_reason is FinishReason.STOP for r in got) or temperature == 0.0


def test_grammar_rows_speculate_beside_free_rows(invariant_pair):
    """Constrained and free requests share verify steps; each gets its plain-engine tokens."""
    plain, spec = invariant_pair
    prompts = repetitive_prompts(32, 4)
    rng = random.Random(32)
    params = [looping(rng, num_tokens_to_generate=40, return_log_probs=True),
              constrained(OBJECTS, 1.0, 7), looping(rng, temperature=0.8, seed=2, num_tokens_to_generate=40),
              constrained(ENUMS, 0.0, 0)]
    before = accepted(spec)
    assert outputs(run(spec, prompts, params)) == outputs(run(plain, prompts, params))
    assert accepted(spec) > before


def test_control_without_the_masks_of_the_drafted_positions_the_output_changes(invariant_pair, monkeypatch):
    """Negative control: a verify step that masks only its first position (every draft row allowing every token)
    emits tokens the grammar forbids where a draft is rejected: not the plain engine's output."""
    plain, spec = invariant_pair
    prompts = repetitive_prompts(31, 3)
    params = [constrained(OBJECTS, temperature, seed) for temperature, seed in ((0.0, 3), (1.0, 4), (1.0, 5))]
    reference = outputs(run(plain, prompts, params))
    real = StructuredOutputs.bitmask

    def first_position_only(self, request_ids, stop_token_ids, drafts=None):
        masks = real(self, request_ids, stop_token_ids, drafts)
        if masks is not None:
            masks[len(request_ids):] = -1
        return masks

    monkeypatch.setattr(StructuredOutputs, "bitmask", first_position_only)
    assert outputs(run(spec, prompts, params)) != reference


def test_drafts_the_grammar_refuses_are_cut_before_the_step(invariant_pair, monkeypatch):
    """The prompt repeats words, so prompt lookup proposes letters; the grammar allows digits only. Every draft
    verified is digits (the refused ones never took a row), while the proposer did propose letters."""
    plain, spec = invariant_pair
    tokenizer = spec.tokenizer
    prompt = tokenizer.encode("one two one two 12 one two one two 121212 one two")
    proposed: list[list[int]] = []
    verified: list[list[int]] = []
    proposer = spec.speculator.proposer
    real_propose, real_verify = proposer.propose, Speculator.verify

    def spy_propose(inputs):
        out = real_propose(inputs)
        proposed.extend(out)
        return out

    def spy_verify(self, sampling, *args, **kwargs):
        verified.extend(s.token_ids[len(s.token_ids) - s.num_drafts:] for s in sampling if s.num_drafts)
        return real_verify(self, sampling, *args, **kwargs)

    monkeypatch.setattr(proposer, "propose", spy_propose)
    monkeypatch.setattr(Speculator, "verify", spy_verify)
    params = [SamplingParams(temperature=0.0, num_tokens_to_generate=40, return_log_probs=True,
                             structured_outputs=StructuredOutputsParams(regex=r"[0-9]{40}"))]
    got = run(spec, [prompt], params)
    assert outputs(got) == outputs(run(plain, [prompt], params))
    assert re.fullmatch(r"[0-9]{40}", tokenizer.decode(got[0].generated_tokens))
    assert verified and all(re.fullmatch(r"[0-9]+", tokenizer.decode(d)) for d in verified)
    assert any(not re.fullmatch(r"[0-9]+", tokenizer.decode(d)) for d in proposed if d)  # cut ones existed


def test_masks_with_drafts_are_each_positions_mask_and_leave_the_matcher_where_it_was(tiny_llama):
    """``bitmask`` with drafts equals, row by row, the mask of a matcher advanced over the drafts before that
    position, and rolls back: the matcher then masks and accepts as before."""
    engine = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(block_size_tokens=16))
    structured, tokenizer = engine.worker.structured, engine.tokenizer
    spec = StructuredOutputsParams(json=OBJECTS)
    text = tokenizer.encode('[{"ok": true, "n": 2}, {"ok": false, "n": 3}]', add_special_tokens=False)
    stops = [frozenset(tokenizer.eos_token_ids)] * 2
    assert structured.add("a", spec, text[:5]) is None
    assert structured.add("b", spec, text[:9]) is None
    drafts = [text[5:9], text[9:11]]
    before = structured.bitmask(["a", "b"], stops)
    masks = structured.bitmask(["a", "b"], stops, drafts)
    assert masks.shape[0] == 2 + 4 + 2
    for row, (request, done, depth) in enumerate([("a", 5, 4), ("b", 9, 2), *[("a", 5, j) for j in range(4)],
                                                  *[("b", 9, j) for j in range(2)]]):
        fresh = StructuredOutputs(tokenizer, structured.vocab_size)
        assert fresh.add("x", spec, text[: done + depth]) is None
        assert masks[row].tolist() == fresh.bitmask(["x"], stops[:1])[0].tolist(), row
    assert structured.bitmask(["a", "b"], stops).tolist() == before.tolist()  # rolled back
    assert structured.draft_prefix("a", drafts[0], stops[0]) == 4
    refused = tokenizer.encode("x", add_special_tokens=False)
    assert structured.draft_prefix("a", drafts[0][:2] + refused + drafts[0][2:], stops[0]) == 2
    assert structured.draft_prefix("a", drafts[0][:1] + list(stops[0])[:1], stops[0]) == 1  # a stop token ends it
    assert structured.accept("a", text[5]) == (False, None)
