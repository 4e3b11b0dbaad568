"""A TorchTitan trainer: ``Llama3Model`` (``Qwen3Model`` for Qwen3 and Qwen3-MoE) built from ``config_from_hf``
(the mode's rotary, norms, inner attention and experts), given the checkpoint the engine serves, run under
``batch_invariant()``: every sequence's completion log probs ``==`` the engine's, over a right-padded batch and a
packed row (TorchTitan's per-document positions), in training mode with autograd on too.

The control: the same model with TorchTitan's own rotary and norms (``CosSinRoPE``, ``RMSNorm``) differs from the
engine. (Its flex attention is left out of the control: on a CPU ``torch.compile`` builds it, minutes in a fresh
cache.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_serve.invariant import batch_invariant

from ..devices import tensor_parallel_device
from .batches import completion_log_probs, packed, right_padded
from .runs import RECIPE_LENGTH as LENGTH

# TorchTitan (and the recipe, which imports it) is imported in the functions that use it: ~2 s of CPU that only the
# worker running this module pays, not every worker's collection.


def _model(config, model_dir: str, dtype: str) -> torch.nn.Module:
    from megatron_kernels import invariant_torchtitan as recipe

    model = recipe.load_hf_checkpoint(config.build(), model_dir)
    return model.to(tensor_parallel_device(1), getattr(torch, dtype))


def _forward(model: torch.nn.Module, batch, masks=None, positions=None) -> torch.Tensor:
    device = model.tok_embeddings.weight.device
    ids = batch.kwargs["input_ids"].to(device)
    with batch_invariant():
        return model(ids, None if positions is None else positions.to(device), masks)


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("llama", "bfloat16"), ("qwen3", "bfloat16"),
                                         ("qwen3_moe", "bfloat16")])
def test_a_model_of_the_recipe_gives_the_engines_log_probs(models, recipe_runs, arch, dtype):
    from megatron_kernels import invariant_torchtitan as recipe

    runs = recipe_runs(arch, dtype)
    engine = [run.log_probs for run in runs]
    model = _model(recipe.config_from_hf(models[arch]), models[arch], dtype).eval()
    sequences = [run.prompt + run.tokens for run in runs]
    batch = right_padded(sequences, LENGTH)
    with torch.no_grad():
        assert completion_log_probs(_forward(model, batch), batch, runs) == engine, "right-padded"
        row = packed(sequences)
        positions = row.kwargs["position_ids"]
        masks = recipe.attention_masks(1, positions.shape[1], positions, device=tensor_parallel_device(1))
        assert completion_log_probs(_forward(model, row, masks, positions), row, runs) == engine, "packed"


def test_in_training_mode_with_autograd_the_log_probs_hold_and_the_weights_get_gradients(models, recipe_runs):
    from megatron_kernels import invariant_torchtitan as recipe

    runs = recipe_runs("llama", "float32")
    model = _model(recipe.config_from_hf(models["llama"]), models["llama"], "float32").train()
    batch = right_padded([run.prompt + run.tokens for run in runs], LENGTH)
    logits = _forward(model, batch)
    assert completion_log_probs(logits.detach(), batch, runs) == [run.log_probs for run in runs]
    ids = batch.kwargs["input_ids"].to(logits.device)
    torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).sum().backward()
    layer = model.layers["0"]
    for weight in (layer.attention.qkv_linear.wq.weight, layer.feed_forward.w1.weight, model.lm_head.weight):
        assert weight.grad is not None and weight.grad.abs().sum() > 0


def _stock(config):
    """``config`` with TorchTitan's own rotary (the rotate-half one: the same weights' row order) and norms."""
    from torchtitan.models.common import CosSinRoPE, RMSNorm

    from megatron_kernels import invariant_torchtitan as recipe

    def norm(invariant: recipe.InvariantRMSNorm.Config) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=invariant.normalized_shape, eps=invariant.eps)

    layer = config.layers[0]
    rope = layer.attention.rope
    attention = dataclasses.replace(
        layer.attention, rope=CosSinRoPE.Config(dim=rope.dim, max_seq_len=rope.max_seq_len, theta=rope.theta))
    layer = dataclasses.replace(layer, attention=attention, attention_norm=norm(layer.attention_norm),
                                ffn_norm=norm(layer.ffn_norm))
    return dataclasses.replace(config, norm=norm(config.norm), layers=[layer] * len(config.layers))


def test_control_torchtitans_own_rotary_and_norms_differ(models, recipe_runs):
    from megatron_kernels import invariant_torchtitan as recipe

    runs = recipe_runs("llama", "bfloat16")
    model = _model(_stock(recipe.config_from_hf(models["llama"])), models["llama"], "bfloat16").eval()
    row = packed([run.prompt + run.tokens for run in runs])
    positions = row.kwargs["position_ids"]
    masks = recipe.attention_masks(1, positions.shape[1], positions, device=tensor_parallel_device(1))
    with torch.no_grad():
        logits = _forward(model, row, masks, positions)
    log_probs = completion_log_probs(logits, row, runs)
    assert all(ours != run.log_probs for ours, run in zip(log_probs, runs))


def test_what_the_recipe_does_not_compute_is_refused(models, tmp_path):
    from megatron_kernels import invariant_torchtitan as recipe

    model = recipe.config_from_hf(models["llama"]).build()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), batch_invariant(), pytest.raises(TypeError, match="takes .*attention_masks"):
        model(ids, None, object())
    config = recipe.config_from_hf(models["llama"])
    rope = dataclasses.replace(config.layers[0].attention.rope, scaling="llama")
    with pytest.raises(ValueError, match="rope scaling 'llama' is not handled"):
        rope.build()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        recipe.load_hf_checkpoint(model, tmp_path)
    with pytest.raises(ValueError, match="mixture of experts is Qwen3-MoE's"):  # a shared expert
        recipe.config_from_hf(models["qwen2_moe"])
