"""A Megatron-core trainer: ``GPTModel`` built with the mode's block spec, given the checkpoint the engine serves,
run under ``batch_invariant()`` over a right-padded batch (gloo, world size 1, for its parallel state): every
sequence's completion log probs ``==`` the engine's (Llama, Qwen3, Qwen3-MoE), in training mode with autograd on
too.

The control: Megatron-core's own local spec (``get_gpt_layer_local_spec``) cannot run on a CPU at all (its
rotary embedding, attention scratch buffer and attention-dropout RNG ask for CUDA); with those calls pointed at the
CPU it runs, and its log probs differ from the engine's.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist

from megatron_serve.invariant import batch_invariant

from ..devices import tensor_parallel_device
from ..helpers import free_port
from .batches import completion_log_probs, packed, right_padded
from .runs import RECIPE_LENGTH as LENGTH

# Megatron-core (and the recipe, which imports it) is imported in the functions that use it: ~3 s of CPU that only
# the worker running this module pays, not every worker's collection.
if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    """Megatron-core's parallel state over gloo, world size 1 (tensor, pipeline and context parallel 1)."""
    from megatron.core import parallel_state

    assert not dist.is_initialized(), "another test left a process group in this process"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _model(model_dir: str, dtype: str, spec=None) -> GPTModel:
    from megatron.core.models.gpt import GPTModel

    from megatron_kernels import invariant_megatron_core as recipe

    config, kwargs = recipe.gpt_config_from_hf(model_dir, getattr(torch, dtype))
    model = GPTModel(config, transformer_layer_spec=spec or recipe.get_gpt_invariant_block_spec(config), **kwargs)
    recipe.load_hf_checkpoint(model, model_dir)
    return recipe.use_invariant_gpt(model.to(tensor_parallel_device(1)))


def _log_probs(model: GPTModel, runs, attention_mask: torch.Tensor | None = None) -> list[list[float]]:
    batch = right_padded([run.prompt + run.tokens for run in runs], LENGTH)
    device = model.embedding.word_embeddings.weight.device
    ids = batch.kwargs["input_ids"].to(device)
    positions = torch.arange(LENGTH, device=device)[None].expand(ids.shape[0], -1)
    with batch_invariant():
        logits = model(ids, positions, attention_mask)
    return completion_log_probs(logits, batch, runs)


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("llama", "bfloat16"), ("qwen3", "bfloat16"),
                                         ("qwen3_moe", "bfloat16")])
def test_a_gpt_model_of_the_invariant_spec_gives_the_engines_log_probs(models, recipe_runs, arch, dtype):
    runs = recipe_runs(arch, dtype)
    model = _model(models[arch], dtype).eval()
    with torch.no_grad():
        assert _log_probs(model, runs) == [run.log_probs for run in runs]


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("qwen3_moe", "bfloat16")])
def test_packed_sequences_give_the_engines_log_probs(models, recipe_runs, arch, dtype):
    """Megatron-core's packed sequences (``thd``: one row, ``cu_seqlens``), as verl's Megatron backend packs them."""
    from megatron.core.packed_seq_params import PackedSeqParams

    runs = recipe_runs(arch, dtype)
    model = _model(models[arch], dtype).eval()
    row = packed([run.prompt + run.tokens for run in runs])
    device = model.embedding.word_embeddings.weight.device
    lengths = [len(run.prompt) + len(run.tokens) for run in runs]
    offsets = torch.tensor([0] + lengths, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    ids = row.kwargs["input_ids"].to(device)
    positions = row.kwargs["position_ids"].to(device)
    with torch.no_grad(), batch_invariant():
        logits = model(ids, positions, None, packed_seq_params=params)
        as_one = model(ids, positions, None)  # the control: the row read as one sequence
    assert completion_log_probs(logits, row, runs) == [run.log_probs for run in runs]
    assert all(ours != run.log_probs for ours, run in zip(completion_log_probs(as_one, row, runs)[1:], runs[1:]))


def test_the_causal_mask_is_taken_and_a_padding_mask_refused(models, recipe_runs):
    runs = recipe_runs("llama", "float32")
    model = _model(models["llama"], "float32").eval()
    device = model.embedding.word_embeddings.weight.device
    causal = torch.ones(1, 1, LENGTH, LENGTH, dtype=torch.bool, device=device).triu(1)
    with torch.no_grad():
        assert _log_probs(model, runs, causal) == [run.log_probs for run in runs]
        left_padding = causal.clone()
        left_padding[..., :3] = True
        with pytest.raises(ValueError, match="one sequence per batch row from position 0"):
            _log_probs(model, runs, left_padding)


def test_in_training_mode_with_autograd_the_log_probs_hold_and_the_weights_get_gradients(models, recipe_runs):
    runs = recipe_runs("llama", "float32")
    model = _model(models["llama"], "float32").train()
    batch = right_padded([run.prompt + run.tokens for run in runs], LENGTH)
    ids = batch.kwargs["input_ids"].to(model.embedding.word_embeddings.weight.device)
    with batch_invariant():
        logits = model(ids, torch.arange(LENGTH, device=ids.device)[None].expand(ids.shape[0], -1), None)
    assert completion_log_probs(logits.detach(), batch, runs) == [run.log_probs for run in runs]
    torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).sum().backward()
    layer = model.decoder.layers[0]
    for weight in (layer.self_attention.linear_qkv.weight, layer.mlp.linear_fc1.weight, model.output_layer.weight):
        assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_control_megatron_cores_local_spec_differs_and_needs_cuda(models, recipe_runs, monkeypatch):
    """On a CPU the local spec stops at CUDA-only code; with those calls pointed at the CPU it runs. On a GPU it
    runs as it is. Either way its log probs are not the engine's."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as megatron_random

    from megatron_kernels import invariant_megatron_core as recipe

    runs = recipe_runs("llama", "bfloat16")
    device = tensor_parallel_device(1)
    config, kwargs = recipe.gpt_config_from_hf(models["llama"], torch.bfloat16)
    stock = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), **kwargs)
    # cast whole, as Megatron-core's Float16Module does (its local norm keeps float32 weights otherwise)
    stock = recipe.load_hf_checkpoint(stock, models["llama"]).to(device, torch.bfloat16).eval()
    causal = torch.ones(1, 1, LENGTH, LENGTH, dtype=torch.bool, device=device).triu(1)  # its default: made on CUDA
    if device == "cpu":
        # a CPU-only torch build says it was not compiled with CUDA; the CUDA build (PyPI's) finds no driver
        with torch.no_grad(), pytest.raises((AssertionError, RuntimeError),
                                            match="not compiled with CUDA|Found no NVIDIA driver"):
            _log_probs(stock, runs, causal)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
        monkeypatch.setattr(megatron_random.CudaRNGStatesTracker, "fork",
                            lambda self, name=None: contextlib.nullcontext())
    with torch.no_grad():
        assert _log_probs(stock, runs, causal) != [run.log_probs for run in runs]


def test_fusions_and_other_mixtures_of_experts_are_refused(models):
    from megatron_kernels import invariant_megatron_core as recipe

    config, _ = recipe.gpt_config_from_hf(models["llama"], torch.float32)
    config.bias_activation_fusion = True
    with pytest.raises(ValueError, match="bias_activation_fusion on: .*set them False"):
        recipe.get_gpt_invariant_block_spec(config)
    config, _ = recipe.gpt_config_from_hf(models["qwen3_moe"], torch.float32)
    config.moe_shared_expert_intermediate_size = 64
    with pytest.raises(ValueError, match="mixture of experts is Qwen3-MoE's"):
        recipe.get_gpt_invariant_block_spec(config)
    with pytest.raises(ValueError, match="mixture of experts is Qwen3-MoE's"):  # a shared expert
        recipe.gpt_config_from_hf(models["qwen2_moe"], torch.float32)


def test_a_checkpoint_that_does_not_fit_is_refused(models, tmp_path):
    from megatron.core.models.gpt import GPTModel

    from megatron_kernels import invariant_megatron_core as recipe

    config, kwargs = recipe.gpt_config_from_hf(models["llama"], torch.float32)
    config.qk_layernorm = True  # the model wants q/k norms the Llama checkpoint has not
    model = GPTModel(config, transformer_layer_spec=recipe.get_gpt_invariant_block_spec(config), **kwargs)
    with pytest.raises(ValueError, match="has no model.layers.0.self_attn.q_norm.weight"):
        recipe.load_hf_checkpoint(model, models["llama"])
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        recipe.load_hf_checkpoint(model, tmp_path)
