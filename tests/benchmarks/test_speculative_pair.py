"""``benchmarks/speculative_pair.py`` trains a target and a draft whose greedy agreement is real: not 0, not 100%.

A few seconds of training on a tiny budget; the engine's speculative seam is not needed (the acceptance is
simulated with the draft-model proposer against the target's own greedy tokens).
"""

from __future__ import annotations


import pytest
import torch

from megatron_serve import InferenceConfig
from megatron_serve.engine.speculative.draft_model import DraftModelProposer
from megatron_serve.engine.speculative.proposer import DraftInput

from tests.benchmarks.scripts import script_fixture

pair_module = script_fixture("pair_module", "speculative_pair", "speculative_pair.py")


@pytest.fixture
def one_thread():
    """Training on 2 threads of a loaded 2-core machine stalls on OpenMP barriers (10 s a step, 0.07 s on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_tiny_trained_pair_loads_and_its_draft_is_accepted_partly(pair_module, tmp_path, one_thread):
    settings = pair_module.PairSettings(steps=30, batch=8, target_hidden=64, target_layers=1, draft_hidden=32)
    target, draft, facts = pair_module.trained_pair(tmp_path, settings)
    assert not facts["cached"] and facts["target_loss"] < 6.0  # below a uniform guess over the corpus' ids (6.23)
    again = pair_module.trained_pair(tmp_path, settings)
    assert again[:2] == (target, draft) and again[2]["cached"]
    prompts = pair_module.held_out_prompts(6, 48)
    length, rate = pair_module.acceptance(target, draft, prompts, k=4, new_tokens=24)
    assert 0.05 < rate < 0.95, rate
    assert 1.0 < length < 5.0
    # the checkpoints load in the serving stack, and the two models disagree somewhere
    config = InferenceConfig(device="cpu", dtype="float32")
    inputs = [DraftInput(str(i), p, 8) for i, p in enumerate(prompts)]
    assert DraftModelProposer(target, config).propose(inputs) != DraftModelProposer(draft, config).propose(inputs)
