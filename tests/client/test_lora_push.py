"""What ``WeightSender.send_lora`` (and ``send(..., adapters=...)``) sends: PEFT's names from each form a trainer
holds, and its refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_serve.client.lora_push import adapter_push, adapter_update

from ..lora_adapters import make_peft_adapter

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


def test_an_adapter_for_a_refit_from_a_directory_or_a_state_dict_and_its_config(tiny_llama, tmp_path):
    """``send(..., adapters=...)``: a PEFT directory and (its state dict, its config) give the same push."""
    directory = make_peft_adapter(tiny_llama, tmp_path / "a", rank=4, seed=3, targets=["q_proj", "v_proj"])
    from_dir = adapter_update("a", str(directory), version=7)
    config = json.loads((directory / "adapter_config.json").read_text())
    from_state = adapter_update("a", (load_file(str(directory / "adapter_model.safetensors")), config), version=7)
    assert from_dir[1] == from_state[1]
    assert (from_dir[1].rank, from_dir[1].alpha, from_dir[1].version, from_dir[1].target_modules) == (
        4, 8.0, 7, ["q_proj", "v_proj"])
    assert [(n, t.shape) for n, t in from_dir[0]] == [(n, t.shape) for n, t in from_state[0]]
    with pytest.raises(ValueError, match="cannot read a PEFT adapter"):
        adapter_update("a", str(tmp_path / "missing"), version=7)
    with pytest.raises(ValueError, match="give a PEFT model, a PEFT directory"):
        adapter_update("a", 3, version=7)
