"""In-process tensors refit (trainer and engine in one process): ``MegatronLLM.refit(named_tensors)``.

The tensors are a real ``transformers`` model's ``named_parameters()`` (Hugging Face names, full
shapes); afterwards outputs equal direct mode on that model's checkpoint, token for token, and
carry the new epoch. A wrong name or shape is refused before any weight changes; a subset
replaces only what it names (fused QKV slices included); tensor-parallel ranks take their slices.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_serve import InferenceConfig, MegatronAsyncLLM, MegatronLLM, SamplingParams
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.client import weight_sender

from ..devices import tensor_parallel_device

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "def add(a, b):", "1 2 3 4"]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=10, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("refit-tensors")
    # 4 query heads over 2 KV heads: tensor parallelism 2 splits q, k and v of the fused QKV weight
    a = str(make_tiny_model(root / "a", seed=0, num_heads=4, num_kv_heads=2))
    b = str(make_tiny_model(root / "b", seed=1, num_heads=4, num_kv_heads=2))
    with MegatronLLM(b) as llm:
        expected_b = [r.generated_tokens for r in llm.generate(PROMPTS, GREEDY)]
    trainer = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
    return a, b, trainer, expected_b


def tokens(llm: MegatronLLM) -> list[list[int]]:
    return [r.generated_tokens for r in llm.generate(PROMPTS, GREEDY)]


def test_named_parameters_of_a_trainer_model_replace_the_weights(models):
    a, _, trainer, expected_b = models
    with MegatronLLM(a) as llm:
        before = tokens(llm)
        assert before != expected_b
        answer = llm.refit(trainer.named_parameters(), epoch=3)
        assert answer["detail"]["epoch"] == 3 and answer["detail"]["source"] == "tensors"
        assert answer["detail"]["engines"]["local"]["load_s"] > 0
        after = llm.generate(PROMPTS, GREEDY)
        assert [r.generated_tokens for r in after] == expected_b
        assert all(set(r.policy_epochs) == {3} for r in after)


def test_a_wrong_name_or_shape_is_refused_before_any_weight_changes(models):
    a, _, trainer, _ = models
    good = list(trainer.named_parameters())
    with MegatronLLM(a) as llm:
        before = tokens(llm)
        wrong_shape = [*good[:3], ("model.layers.1.mlp.down_proj.weight", torch.zeros(64, 7))]
        with pytest.raises(ValueError, match="does not fit"):
            llm.refit(wrong_shape)
        with pytest.raises(ValueError, match="'model.layers.9.self_attn.q_proj.weight' has no place"):
            llm.refit([*good, ("model.layers.9.self_attn.q_proj.weight", torch.zeros(64, 64))])
        with pytest.raises(ValueError, match="given twice"):
            llm.refit([good[0], good[0]])
        with pytest.raises(ValueError, match="dtype torch.int64"):
            llm.refit([("model.norm.weight", torch.zeros(64, dtype=torch.int64))])
        assert llm.engine.epoch == 0 and tokens(llm) == before


def test_a_subset_replaces_only_what_it_names(models):
    a, _, trainer, _ = models
    params = dict(trainer.named_parameters())
    with MegatronLLM(a) as llm:
        model = llm.engine.model
        attention = model.model.layers[0].self_attn.qkv_proj.weight
        old = attention.detach().clone()
        down = model.model.layers[1].mlp.down_proj.weight.detach().clone()
        llm.refit([("model.layers.0.self_attn.k_proj.weight", params["model.layers.0.self_attn.k_proj.weight"])])
        q_rows, k_rows = 64, params["model.layers.0.self_attn.k_proj.weight"].shape[0]
        assert torch.equal(attention[:q_rows], old[:q_rows])  # q untouched
        assert torch.equal(attention[q_rows:q_rows + k_rows],
                           params["model.layers.0.self_attn.k_proj.weight"].to(attention.device))
        assert torch.equal(attention[q_rows + k_rows:], old[q_rows + k_rows:])  # v untouched
        assert torch.equal(model.model.layers[1].mlp.down_proj.weight, down)
        assert llm.engine.epoch == 1


@pytest.mark.slow
def test_tensor_parallel_ranks_take_their_slices_of_in_process_tensors(models):
    a, _, trainer, expected_b = models
    with MegatronLLM(a, InferenceConfig(tensor_parallel_size=2, device=tensor_parallel_device(2))) as llm:
        llm.refit(trainer.named_parameters(), epoch=2)
        assert tokens(llm) == expected_b


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_coordinator_mode_sends_in_process_tensors_over_a_collective(models, monkeypatch):
    a, _, trainer, expected_b = models
    # as on a GPU machine: a remote fleet would get NCCL, but this one's engine shares the machine's GPUs
    monkeypatch.setattr(weight_sender, "default_backend", lambda: "nccl")
    async with MegatronAsyncLLM(a, InferenceConfig(num_kv_blocks=64), use_coordinator=True) as llm:
        await llm.pause()
        ack = await llm.refit(trainer.named_parameters(), epoch=5)
        assert ack["detail"]["epoch"] == 5 and ack["detail"]["sender"]["world_size"] == 2
        assert ack["detail"]["sender"]["backend"] == "gloo"  # the engine shares this machine's GPUs
        await llm.unpause()
        results = await llm.generate(PROMPTS, GREEDY)
        assert [r.generated_tokens for r in results] == expected_b and all(r.policy_epochs[0] == 5 for r in results)
