"""A step's requests in micro-batches (``engine.micro_batches``, what pipeline stages pass on one after another): each
micro-batch is a batch of its own whole requests, and its rows compute what they compute in the whole step. Checked on
one stage in the engine's own steps (``LlamaModel.pipelined`` runs one stage too): under ``--batch-invariant``, where a
row's bits do not depend on the rows beside it, ``==`` the whole step's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.engine.micro_batches import micro_batches, request_bounds
from megatron_serve.engine.runner import attention_metadata
from megatron_serve.model.attention import ForwardContext

from ..prompts import PROMPTS


def test_micro_batches_are_runs_of_whole_requests_of_about_equal_tokens():
    assert request_bounds(np.array([1, 1, 1, 1]), 2) == [0, 2, 4]
    assert request_bounds(np.array([1, 1, 12, 2]), 2) == [0, 3, 4]  # a long chunk is not cut
    assert request_bounds(np.array([9, 1, 1, 1]), 3) == [0, 1, 2, 4]  # at least one request each
    assert request_bounds(np.array([5, 5]), 4) == [0, 1, 2]  # fewer requests than micro-batches
    assert request_bounds(np.array([7]), 3) == [0, 1]


def test_a_steps_micro_batches_compute_its_rows(tiny_llama):
    """Decode rows and prefill chunks (a 16-token budget chunks the prompts, which arrive as others decode), in 1 to
    4 micro-batches: the final hidden states ``==`` the whole step's, for every step of the run."""
    llm = MegatronLLM(tiny_llama, InferenceConfig(device="cpu", dtype="float32", block_size_tokens=8,
                                                  max_batch_tokens=16, batch_invariant=True))
    runner, model = llm.engine.worker.runner, llm.engine.worker.runner.model
    original, seen = runner.run_plan, []

    def run_plan(plan, kv_caches, *args, **kwargs):
        result = original(plan, kv_caches, *args, **kwargs)  # its cache writes done: the passes below rewrite them
        dev = runner.buffers.dev
        ids, positions = dev["token_ids"][: plan.num_tokens], dev["positions"][: plan.num_tokens]
        whole = model(ids, positions, ForwardContext(attention_metadata(runner.buffers, plan), kv_caches))
        for count in (2, 3, 4):
            parts = micro_batches(runner.buffers, plan, ForwardContext(attention_metadata(runner.buffers, plan),
                                                                       kv_caches), count)
            assert torch.equal(model.pipelined(ids, positions, parts), whole), (plan, count)
            seen.append((plan.num_decode > 0 and plan.num_prefill > 0, len(parts)))
        return result

    runner.run_plan = run_plan
    try:
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
        llm.generate(PROMPTS[:5], params)
    finally:
        llm.close()
    assert (True, 4) in seen and (False, 3) in seen, "no step mixed decode rows and chunks in several micro-batches"


def test_a_bad_micro_batch_count_is_refused_by_name():
    with pytest.raises(ValueError, match="pipeline_micro_batches must be a positive integer or unset, got 0"):
        InferenceConfig(device="cpu", pipeline_parallel_size=2, pipeline_micro_batches=0)
    assert InferenceConfig(device="cpu", pipeline_parallel_size=3).micro_batches == 3
    assert InferenceConfig(device="cpu", pipeline_parallel_size=3, pipeline_micro_batches=1).micro_batches == 1
    assert InferenceConfig(device="cpu", pipeline_micro_batches=4).micro_batches == 1  # no stages: nothing to split


def test_the_flag_round_trips_through_engine_argv():
    import argparse  # noqa: PLC0415

    from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args  # noqa: PLC0415
    from megatron_serve.fleet.argv import inference_config_to_argv  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    config = InferenceConfig(device="cpu", pipeline_parallel_size=2, pipeline_micro_batches=4)
    assert "--pipeline-micro-batches" in inference_config_to_argv(config)
    assert inference_config_from_args(parser.parse_args(inference_config_to_argv(config))).micro_batches == 4
