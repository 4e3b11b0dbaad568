"""MoE weights: directory refit, a trainer's tensors (in process and over the collective weight sync), and
incomplete checkpoints."""

from __future__ import annotations

import shutil

import msgspec
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronAsyncLLM, MegatronLLM, SamplingParams
from megatron_serve.model.loader import build_model, load_model, load_weights
from megatron_serve.model.parallel import TensorParallel
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.wire.request import RoutingArray

from ..prompts import PROMPTS

GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True, return_routing_indices=True)
CONFIG = InferenceConfig(dtype="float32")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-weights")
    return (str(make_tiny_model(root / "a", seed=0, arch="qwen3_moe")),
            str(make_tiny_model(root / "b", seed=1, arch="qwen3_moe")),
            str(make_tiny_model(root / "four", seed=2, arch="qwen3_moe", num_experts=4)))


def answers(llm: MegatronLLM):
    outs = llm.generate(PROMPTS[:3], GREEDY)
    return [o.generated_tokens for o in outs], [o.routing_indices.tolist() for o in outs]


def without(model_dir: str, target, drop: str) -> str:
    """A copy of ``model_dir`` whose checkpoint lacks tensor ``drop``."""
    shutil.copytree(model_dir, target)
    tensors = load_file(f"{target}/model.safetensors")
    del tensors[drop]
    save_file(tensors, f"{target}/model.safetensors", metadata={"format": "pt"})
    return str(target)


def test_directory_refit_of_moe_weights(checkpoints):
    a, b, four = checkpoints
    expected_b = answers(MegatronLLM(b, CONFIG))
    llm = MegatronLLM(a, CONFIG)
    before = answers(llm)
    assert before != expected_b
    with pytest.raises(ValueError, match="moe is .*num_experts=4.* but the serving model has .*num_experts=8"):
        llm.engine.memory.refit(four)
    assert answers(llm) == before  # a refused source leaves the old experts serving
    llm.engine.memory.refit(b)
    assert answers(llm) == expected_b


def test_tensors_by_name_load_like_the_directory(checkpoints):
    """A trainer's ``named_parameters()`` (transformers 5 stacks each layer's experts) fills every piece,
    on every rank, exactly as the Hub layout of the directory does."""
    a = checkpoints[0]
    trainer = transformers.AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    assert any(name.endswith("mlp.experts.gate_up_proj") for name, _ in trainer.named_parameters())
    for tp in (TensorParallel(0, 1), TensorParallel(1, 2)):
        from_dir = load_model(a, torch.float32, "cpu", tp)
        from_tensors = build_model(from_dir.config, torch.float32, "cpu", tp)
        load_weights(from_tensors, ((n, p.detach()) for n, p in trainer.named_parameters()))
        for (name, expected), (_, actual) in zip(from_dir.named_parameters(), from_tensors.named_parameters()):
            torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)


def test_a_trainer_refits_the_experts_in_process(checkpoints):
    """``refit(named_parameters())`` of a trainer holding other weights: the stacked experts are checked
    (a wrong shape is refused before anything changes), then replaced, and the answers and routing follow."""
    a, b, _ = checkpoints
    expected_b = answers(MegatronLLM(b, CONFIG))
    trainer = transformers.AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
    with MegatronLLM(a, CONFIG) as llm:
        before = answers(llm)
        stacked = "model.layers.1.mlp.experts.gate_up_proj"
        with pytest.raises(ValueError, match=f"weight {stacked}: .*does not fit"):
            llm.refit([(stacked, torch.zeros(8, 64, 64))])
        assert answers(llm) == before
        llm.refit(trainer.named_parameters(), epoch=2)
        assert answers(llm) == expected_b


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_experts_over_the_collective_weight_sync(checkpoints):
    a, b, _ = checkpoints
    tokens_b, routing_b = answers(MegatronLLM(b, CONFIG))
    trainer = transformers.AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
    async with MegatronAsyncLLM(a, InferenceConfig(dtype="float32", num_kv_blocks=64), use_coordinator=True) as llm:
        await llm.pause()
        ack = await llm.refit(trainer.named_parameters(), epoch=4)
        assert ack["detail"]["epoch"] == 4 and ack["detail"]["sender"]["world_size"] == 2
        await llm.unpause()
        results = await llm.generate(PROMPTS[:3], GREEDY)
    assert [r.generated_tokens for r in results] == tokens_b
    assert [r.routing_indices.tolist() for r in results] == routing_b


def test_a_missing_expert_is_named(checkpoints, tmp_path):
    broken = without(checkpoints[0], tmp_path / "no-expert", "model.layers.1.mlp.experts.5.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.experts\.gate_up_proj "
                                         r"\(up of expert 5\)"):
        load_model(broken, torch.float32, "cpu")


def test_a_missing_fused_part_is_named(tiny_llama, tmp_path):
    broken = without(tiny_llama, tmp_path / "no-k", "model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.0\.self_attn\.qkv_proj\.weight \(k\)"):
        load_model(broken, torch.float32, "cpu")


def test_routing_survives_msgpack(checkpoints):
    """As a moved request carries its rows to its next engine (``EngineRequest.routing_indices``)."""
    out = MegatronLLM(checkpoints[0], CONFIG).generate(PROMPTS[:1], GREEDY)[0]
    copy = msgspec.msgpack.decode(msgspec.msgpack.encode(RoutingArray.of(out.routing_indices)), type=RoutingArray).array()
    assert copy.dtype == np.uint8
    np.testing.assert_array_equal(copy, out.routing_indices)


@pytest.mark.parametrize(("rows", "message"), [((2, 3, 2), "do not fit this model's 2 MoE layers x top-2"),
                                               ((9, 2, 2), "carries 9 routing rows, more than its tokens")])
def test_a_continuation_with_foreign_routing_rows_fails_alone(checkpoints, rows, message):
    llm = MegatronLLM(checkpoints[0], CONFIG)
    request = DynamicInferenceRequest("continued", None, [5, 6, 7], GREEDY)
    request.routing_indices = np.zeros(rows, dtype=np.uint8)
    llm.engine.add_request(request)
    [output] = llm.engine.step()
    assert output.finished and request.status.value == "FAILED" and message in request.error
