"""PEFT checkpoints: read with PEFT's scaling, checked against the base model, bad ones refused by name."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_serve.model.config import ModelConfig
from megatron_serve.model.lora.checkpoint import LoraAdapterError, read_adapter
from megatron_serve.model.tiny import make_tiny_model

from ..lora_adapters import make_peft_adapter


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lora-base"), seed=0, arch="llama")


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    return make_peft_adapter(base, tmp_path_factory.mktemp("adapter"), rank=8, seed=1)


def _copy(adapter, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(adapter, target)
    return target


def test_reads_every_projection_with_peft_scaling(base, adapter):
    config = ModelConfig.from_dir(base)
    read = read_adapter("a", adapter, config, max_rank=16)
    assert read.rank == 8 and read.scaling == 2.0  # lora_alpha 16 / r 8
    assert sorted({p for _, p in read.weights}) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                    "up_proj", "v_proj"]
    assert {layer for layer, _ in read.weights} == set(range(config.num_layers))
    raw = load_file(adapter / "adapter_model.safetensors")
    a, b = read.weights[(1, "v_proj")]
    assert torch.equal(a, raw["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"])
    assert torch.equal(b, raw["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"] * 2.0)


def test_rslora_scales_by_the_square_root_of_the_rank(base, tmp_path):
    path = make_peft_adapter(base, tmp_path / "rs", rank=4, seed=2, alpha=8, use_rslora=True, targets=["q_proj"])
    read = read_adapter("rs", path, ModelConfig.from_dir(base), max_rank=16)
    assert read.scaling == 8 / math.sqrt(4)
    assert set(read.weights) == {(0, "q_proj"), (1, "q_proj")}


def _edit_config(path, **changes):
    config_path = path / "adapter_config.json"
    raw = json.loads(config_path.read_text())
    raw.update(changes)
    config_path.write_text(json.dumps(raw))


def _edit_tensors(path, edit):
    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def _bad_rank(path):
    pass  # the adapter is rank 8; the limit below is 4


def _bad_module(path):
    _edit_config(path, target_modules=["q_proj", "embed_tokens"])


def _bad_tensor_name(path):
    _edit_tensors(path, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}))


def _missing_layer(path):
    _edit_tensors(path, lambda t: t.update({
        "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8)}))


def _bad_shape(path):
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    _edit_tensors(path, lambda t: t.update({key: torch.zeros(8, 100)}))


def _lone_half(path):
    _edit_tensors(path, lambda t: t.pop("base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"))


def _dora(path):
    _edit_config(path, use_dora=True)


def _no_weights(path):
    (path / "adapter_model.safetensors").unlink()


@pytest.mark.parametrize("break_it, max_rank, message", [
    (_bad_rank, 4, "rank 8 is above --max-lora-rank 4"),
    (_bad_module, 16, r"target_modules \['embed_tokens'\] are not supported"),
    (_bad_tensor_name, 16, "lm_head.lora_A.weight is not a LoRA weight"),
    (_missing_layer, 16, "layers.7.self_attn.q_proj.lora_A.weight names a module the base model does not have"),
    (_bad_shape, 16, r"layers.0.down_proj has lora_A \(8, 100\)"),
    (_lone_half, 16, "layers.0.k_proj has lora_A without its pair"),
    (_dora, 16, "use_dora=True is not supported"),
    (_no_weights, 16, "no adapter_model.safetensors"),
])
def test_bad_adapters_are_refused_naming_the_problem(base, adapter, tmp_path, break_it, max_rank, message):
    path = _copy(adapter, tmp_path)
    break_it(path)
    with pytest.raises(LoraAdapterError, match=message) as caught:
        read_adapter("broken", path, ModelConfig.from_dir(base), max_rank=max_rank)
    assert "'broken'" in str(caught.value)


def test_a_path_that_does_not_exist_is_refused(base, tmp_path):
    with pytest.raises(LoraAdapterError, match="nowhere' does not exist"):
        read_adapter("gone", tmp_path / "nowhere", ModelConfig.from_dir(base), max_rank=16)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(LoraAdapterError, match="a-file' is not a directory"):
        read_adapter("file", tmp_path / "a-file", ModelConfig.from_dir(base), max_rank=16)
