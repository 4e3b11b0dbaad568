"""Speculation for requests that record their expert routing (MoE, ``return_routing_indices``) and for requests with
images: the same tokens, log probs and routing rows as without speculation.

A verify step computes its drafts' rows before knowing which are accepted: a row of a rejected draft is the routing
of a token the request never had, so only accepted drafts' rows are recorded, each before the token its draft
produced (a stop token among accepted drafts ends the record where it ends the tokens). Image requests speculate
once their prompt is in the cache: the verify rows are text positions after the images, whose rotary positions
(Qwen2-VL's three-way positions, shifted by the images' grid) come from the same placement as a decode row's.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from msgspec.structs import replace

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.engine import scheduler
from megatron_serve.model.tiny import make_tiny_model

from ..images import png
from .test_speculative import SPEC, looping, repetitive_prompts

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def generate(model: str, prompts: list, params: list[SamplingParams], speculative: bool, invariant: bool = True
             ) -> tuple[list, int]:
    """Outputs of ``prompts`` in one batch and the speculative drafts accepted (0 without speculation)."""
    llm = MegatronLLM(model, InferenceConfig(block_size_tokens=8, batch_invariant=invariant,
                                             speculative=SPEC if speculative else None))
    try:
        results = llm.generate(prompts, params)
        return results, llm.engine.stats.counters["spec_decode_num_accepted_tokens"]
    finally:
        llm.close()


def routed(results: list) -> list[tuple]:
    return [(r.generated_tokens, r.generated_log_probs, r.finish_reason, np.asarray(r.routing_indices).tolist())
            for r in results]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("spec-moe"), seed=3, arch="qwen3_moe"))


def moe_workload(model: str) -> tuple[list[list[int]], list[SamplingParams]]:
    """Looping greedy requests, and the same again stopped by their 13th token (a stop among accepted drafts)."""
    prompts = repetitive_prompts(51, 4)
    rng = random.Random(51)
    params = [looping(rng, num_tokens_to_generate=40, return_log_probs=True, return_routing_indices=True)
              for _ in prompts]
    free, _ = generate(model, prompts, params, speculative=False)
    stopped = [replace(p, stop_token_ids=[r.generated_tokens[12]]) for p, r in zip(params, free)]
    return prompts + prompts, params + stopped


def test_routing_indices_with_speculation_are_the_plain_engines(tiny_moe):
    prompts, params = moe_workload(tiny_moe)
    plain, _ = generate(tiny_moe, prompts, params, speculative=False)
    spec, accepted = generate(tiny_moe, prompts, params, speculative=True)
    assert accepted > 0
    assert routed(spec) == routed(plain)
    # a stopped request's rows end at the position that sampled its stop token, its last token (never processed)
    assert [len(r.routing_indices) for r in spec[4:]] == [len(r.prompt_tokens) + len(r.generated_tokens) - 1
                                                          for r in spec[4:]]


def test_control_recording_every_draft_row_records_rejected_drafts_routing(tiny_moe, monkeypatch):
    """Negative control: recording a verify step's rows as they come (rejected drafts' included) gives positions
    the routing of tokens the request never had, and a stopped request rows past its end."""
    prompts, params = moe_workload(tiny_moe)
    plain, _ = generate(tiny_moe, prompts, params, speculative=False)
    record_step = scheduler.record_step

    def every_row(entries, rows):
        return record_step([(sequence, start, count, 0) for sequence, start, count, _ in entries], rows)

    monkeypatch.setattr(scheduler, "record_step", every_row)
    spec, accepted = generate(tiny_moe, prompts, params, speculative=True)
    assert accepted > 0
    assert [r[:3] for r in routed(spec)] == [r[:3] for r in routed(plain)]  # the tokens do not notice
    assert routed(spec) != routed(plain)


def test_requests_with_images_speculate_and_emit_the_plain_engines_tokens(tmp_path):
    """``--batch-invariant`` serves text models only, so this runs in the default mode: the same tokens, log probs
    within float32 rounding (verify rows run prefill-shaped, as in test_speculative's default-mode test)."""
    model = str(make_tiny_model(tmp_path / "qwen2-vl", seed=5, arch="qwen2_vl"))
    rng = random.Random(53)
    prompts = [{"prompt": f"Look {IMAGE} here look here look here", "images": [png(84, 112, 1)]},
               {"prompt": f"{IMAGE} and {IMAGE} and and", "images": [png(56, 56, 2), png(140, 70, 3)]},
               "text only, text only"]
    params = [looping(rng, num_tokens_to_generate=24, return_log_probs=True) for _ in prompts]
    plain, _ = generate(model, prompts, params, speculative=False, invariant=False)
    alone, accepted = generate(model, prompts[:2], params[:2], speculative=True, invariant=False)
    assert accepted > 0  # the image requests' own drafts (no text request beside them)
    mixed, _ = generate(model, prompts, params, speculative=True, invariant=False)
    for ours, theirs in zip(alone + mixed, plain[:2] + plain):
        assert ours.generated_tokens == theirs.generated_tokens
        assert ours.generated_log_probs == pytest.approx(theirs.generated_log_probs, abs=1e-5)


def test_control_image_rows_at_text_positions_change_the_tokens(tmp_path, monkeypatch):
    """Negative control for the test above: generated positions (verify rows among them) placed at their token
    index, without the images' shift, get other log probs: the test's equality does rest on those positions."""
    from megatron_serve.model.vision import mrope  # noqa: PLC0415

    model = str(make_tiny_model(tmp_path / "qwen2-vl", seed=5, arch="qwen2_vl"))
    prompts = [{"prompt": f"Look {IMAGE} here look here look here", "images": [png(84, 112, 1)]}]
    params = [looping(random.Random(53), num_tokens_to_generate=24, return_log_probs=True)]
    plain, _ = generate(model, prompts, params, speculative=False, invariant=False)
    scalar = mrope.MropePositions.scalar
    monkeypatch.setattr(mrope.MropePositions, "scalar",
                        lambda self, index: index if index >= len(self.prompt[0]) else scalar(self, index))
    shifted, _ = generate(model, prompts, params, speculative=True, invariant=False)
    assert shifted[0].generated_log_probs != pytest.approx(plain[0].generated_log_probs, abs=1e-4)
