"""LoRA on MoE experts (issue 40): PEFT adapters whose ``target_parameters`` adapt the experts of
Qwen2-MoE, Qwen3-MoE and Mixtral give the greedy tokens and float32 log probs of transformers + PEFT."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_serve.model.lora.checkpoint import LoraAdapterError, read_adapter
from megatron_serve.model.tiny import make_tiny_model

from ..hf_greedy import greedy_choices
from ..lora_adapters import make_peft_adapter
from ..prompts import PROMPTS
from .test_lora_engine import _engine, _greedy, assert_adapter_matches_peft, assert_mixed_batch_matches_alone

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {  # name: (rank, target_modules, target_parameters)
    "attention+experts": (8, ["q_proj", "v_proj"], EXPERTS),
    "experts": (4, [], EXPERTS),
    "down": (16, [], EXPERTS[1:]),
}


def _reference(model, token_lists, generated_lists):
    """transformers' greedy tokens and log probs, end of text included (the engine ignores it: ignore_eos)."""
    return greedy_choices(model, token_lists, generated_lists, eos=[])


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe", "mixtral"])
def moe(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = make_tiny_model(root / "base", seed=5, arch=request.param)
    adapters = {name: str(make_peft_adapter(base, root / name.replace("+", "-"), rank=rank, seed=rank + 100,
                                            targets=targets, parameters=parameters, b_scale=2.0))
                for name, (rank, targets, parameters) in ADAPTERS.items()}
    return base, adapters


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_moe_expert_lora_equals_transformers_with_peft(moe, name):
    base, adapters = moe
    assert_adapter_matches_peft(_engine(base, adapters), base, adapters[name], name, _reference)


def test_moe_mixed_batch_gives_each_row_what_it_gets_alone(moe):
    base, adapters = moe
    engine = _engine(base, adapters)
    names = [None, *ADAPTERS]
    assert_mixed_batch_matches_alone(engine, [(prompt, _greedy(names[i % len(names)]))
                                              for i, prompt in enumerate(PROMPTS)])


def test_expert_tensors_need_their_target_parameters(moe, tmp_path):
    """PEFT names expert tensors by nesting depth: without target_parameters they cannot be placed (refused)."""
    base, adapters = moe
    broken = tmp_path / "broken"
    shutil.copytree(adapters["experts"], broken)
    config_path = broken / "adapter_config.json"
    raw = json.loads(config_path.read_text())
    raw["target_parameters"] = None
    config_path.write_text(json.dumps(raw))
    engine = _engine(base, {})
    with pytest.raises(LoraAdapterError, match="mlp.experts.base_layer.lora_A.weight is not a LoRA weight"):
        read_adapter("broken", broken, engine.model.config, 16)
    raw["target_parameters"] = ["mlp.gate.weight"]
    config_path.write_text(json.dumps(raw))
    with pytest.raises(LoraAdapterError, match="target_parameters \\['mlp.gate.weight'\\] are not supported"):
        read_adapter("broken", broken, engine.model.config, 16)
