"""What ``WeightSender.send_lora`` sends: PEFT's names from each form a trainer holds, and its refusals."""

from __future__ import annotations

import pytest
import torch

from megatron_serve.client.lora_push import adapter_push

Q = "model.layers.0.self_attn.q_proj"
SAVED = "base_model.model.model.layers.0.self_attn.q_proj"


def test_module_pairs_become_peft_names():
    a, b = torch.zeros(4, 8), torch.zeros(8, 4)
    named, push = adapter_push("p", {Q: (a, b)}, version=3, rank=4, alpha=8, use_rslora=False, target_modules=None)
    assert [n for n, _ in named] == [f"{SAVED}.lora_A.weight", f"{SAVED}.lora_B.weight"]
    assert (push.name, push.version, push.rank, push.alpha, push.target_parameters) == ("p", 3, 4, 8.0, None)


def test_state_dict_names_lose_the_adapter_name():
    state = {f"{SAVED}.lora_A.default.weight": torch.zeros(4, 8), f"{Q}.lora_B.weight": torch.zeros(8, 4)}
    named, _ = adapter_push("p", state, version=0, rank=4, alpha=4, use_rslora=False, target_modules=None)
    assert [n for n, _ in named] == [f"{SAVED}.lora_A.weight", f"{SAVED}.lora_B.weight"]


def test_a_peft_model_gives_its_config(tiny_llama):
    import peft  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj"],
                                                      use_rslora=True))
    named, push = adapter_push("p", model, version=1, rank=None, alpha=None, use_rslora=False, target_modules=None)
    assert (push.rank, push.alpha, push.use_rslora, push.target_modules) == (4, 12.0, True, ["q_proj", "v_proj"])
    assert {n for n, _ in named} == {f"base_model.model.model.layers.{layer}.self_attn.{p}.lora_{h}.weight"
                                     for layer in range(base.config.num_hidden_layers) for p in ("q_proj", "v_proj")
                                     for h in "AB"}


@pytest.mark.parametrize("name, weights, version, rank, message", [
    ("", {}, 1, 4, "a LoRA adapter needs a non-empty name"),
    ("p", {}, -1, 4, "version must be an integer >= 0, got -1"),
    ("p", {Q: (torch.zeros(1),)}, 1, 4, "give \\(lora_A, lora_B\\), got 1 tensors"),
    ("p", [torch.zeros(1)], 1, 4, "must be a PEFT model, a state dict or \\{module: \\(A, B\\)\\}, got list"),
    ("p", {}, 1, None, "give rank and alpha"),
])
def test_refusals_name_the_problem(name, weights, version, rank, message):
    with pytest.raises(ValueError, match=message):
        adapter_push(name, weights, version=version, rank=rank, alpha=8, use_rslora=False, target_modules=None)
