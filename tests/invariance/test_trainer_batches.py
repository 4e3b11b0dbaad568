"""The recipe on the batches trainers make: right-padded to any length, left-padded, packed (``position_ids``
restarting, or flash-attention's ``cu_seq_lens``), gradient checkpointing with autograd on. Every sequence's
completion log probs ``==`` the engine's for it. Casting a loaded model and autocast are refused with what to
do. The controls: the packed batch read as one sequence per row (what the recipe did before), and the cast
model with its refusal taken away, both differ from the engine.
"""

from __future__ import annotations

import random

import pytest
import torch

import megatron_kernels.invariant_trainer as invariant
from megatron_serve.invariant import batch_invariant

from .batches import LAYOUTS, Batch, completion_log_probs, packed, right_padded
from .runs import load_trainer_model, run_prompts

COMPLETION = 8


def _prompts(lengths: list[int], seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in lengths]


def _trainer(model: torch.nn.Module, batch: Batch, runs) -> list[list[float]]:
    kwargs = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in batch.kwargs.items()}
    with torch.no_grad(), batch_invariant():
        logits = model(**kwargs).logits
    return completion_log_probs(logits, batch, runs)


@pytest.fixture(scope="module")
def served(models):
    """Per (arch, dtype): the engine's runs of four prompts (lengths that pad or pack unevenly) and the model."""
    cache = {}

    def get(arch: str, dtype: str):
        if (arch, dtype) not in cache:
            runs = run_prompts(models[arch], dtype, _prompts([56, 23, 40, 9]), COMPLETION)
            cache[arch, dtype] = runs, load_trainer_model(models[arch], dtype).eval()
        return cache[arch, dtype]
    return get


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_every_layout_gives_each_sequence_the_engines_log_probs(served, arch, dtype):
    runs, model = served(arch, dtype)
    engine = [run.log_probs for run in runs]
    sequences = [run.prompt + run.tokens for run in runs]
    for name, layout in LAYOUTS.items():
        assert _trainer(model, layout(sequences), runs) == engine, f"{arch} {dtype}, {name}: differs from the engine"


@pytest.mark.parametrize("batch, length", [(2, 64), (3, 96), (8, 256)])
def test_batches_padded_to_whole_key_blocks(models, batch, length):
    """Lengths a multiple of the attention's 32-key block (these crashed: the keys reached a ``.view`` strided);
    the longest sequence fills the row, the others are right-padded."""
    lengths = [length - COMPLETION] + [random.Random(i).randrange(8, length - COMPLETION) for i in range(batch - 1)]
    runs = run_prompts(models["llama"], "float32", _prompts(lengths), COMPLETION)
    model = load_trainer_model(models["llama"], "float32").eval()
    trainer = _trainer(model, right_padded([run.prompt + run.tokens for run in runs], length), runs)
    assert trainer == [run.log_probs for run in runs]


@pytest.mark.parametrize("recompute_in_the_mode", [True, False])
def test_gradient_checkpointing_with_autograd_on(served, monkeypatch, recompute_in_the_mode):
    """Training mode, gradient checkpointing, gradients on: the forward's log probs are the engine's and the
    backward reaches the weights. The control: a recompute outside the mode (the autograd engine runs the
    backward without the thread's torch-function modes) saves other tensors, and checkpointing refuses it."""
    runs, model = served("llama", "float32")
    if not recompute_in_the_mode:
        monkeypatch.setattr(invariant, "_recompute_in_the_mode", lambda module: None)
    model.activation_checkpointing_enable()
    model.train()
    try:
        batch = packed([run.prompt + run.tokens for run in runs])
        batch.kwargs = {k: v.to(model.device) for k, v in batch.kwargs.items()}
        with batch_invariant():
            logits = model(**batch.kwargs).logits
            log_probs = completion_log_probs(logits, batch, runs)
            flat = torch.log_softmax(logits.float(), -1)[0]
            loss = flat[torch.arange(flat.shape[0] - 1, device=flat.device), batch.kwargs["input_ids"][0, 1:]].sum()
            if not recompute_in_the_mode:
                with pytest.raises(torch.utils.checkpoint.CheckpointError):
                    loss.backward()
                return
            loss.backward()
        assert log_probs == [run.log_probs for run in runs]
        assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    finally:
        model.activation_checkpointing_disable()
        model.zero_grad(set_to_none=True)
        model.eval()


def test_control_the_packed_row_read_as_one_sequence_differs(served, monkeypatch):
    """Without the layout (each row one sequence, as before) a packed sequence sees the ones before it."""
    runs, model = served("llama", "float32")
    monkeypatch.setattr(invariant, "batch_layout", lambda batch, length, *rest: invariant._cached_layout(
        batch, length, length, rest[-1]))
    monkeypatch.setattr(invariant, "_LAST_PLAN", invariant._LastPlan())  # not the earlier tests' plan
    trainer = _trainer(model, packed([run.prompt + run.tokens for run in runs]), runs)
    assert trainer[0] == runs[0].log_probs  # the first sequence has nothing before it
    assert all(t != run.log_probs for t, run in zip(trainer[1:], runs[1:]))


def test_the_plan_is_reused_for_equal_inputs_only(served):
    """Every layer of a forward reuses the first layer's plan; a batch with other positions (equal shapes) and
    the same position tensor changed in place are planned anew, each giving its own sequences' log probs."""
    runs, model = served("llama", "float32")
    engine = [run.log_probs for run in runs]
    batch = packed([run.prompt + run.tokens for run in runs])
    assert _trainer(model, batch, runs) == engine
    reordered = packed([run.prompt + run.tokens for run in runs[::-1]])
    assert _trainer(model, reordered, runs[::-1]) == engine[::-1]
    positions = batch.kwargs["position_ids"]
    assert _trainer(model, batch, runs) == engine
    positions.copy_(reordered.kwargs["position_ids"])  # in place, the same tensor
    batch.kwargs["input_ids"] = reordered.kwargs["input_ids"]
    assert _trainer(model, Batch(batch.kwargs, reordered.places), runs[::-1]) == engine[::-1]


def test_a_packed_row_without_restarting_positions_is_refused(served):
    runs, model = served("llama", "float32")
    batch = packed([run.prompt + run.tokens for run in runs])
    batch.kwargs["position_ids"] = torch.arange(batch.kwargs["input_ids"].shape[1])[None]
    batch.kwargs["cu_seq_lens_q"] = torch.tensor([0, len(runs[0].prompt) + COMPLETION,
                                                  batch.kwargs["input_ids"].shape[1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="starts at position .*pass position_ids restarting at 0"):
        _trainer(model, batch, runs)


def test_a_left_padded_batch_without_position_ids_is_refused(served):
    runs, model = served("llama", "float32")
    batch = LAYOUTS["left-padded to 96"]([run.prompt + run.tokens for run in runs])
    del batch.kwargs["position_ids"]
    with pytest.raises(ValueError, match=r"attention_mask.cumsum\(-1\) - 1"):
        _trainer(model, batch, runs)


def test_a_model_cast_after_loading_is_refused_and_differs(models, monkeypatch):
    runs, loaded = run_prompts(models["llama"], "bfloat16", _prompts([40]), COMPLETION), None
    loaded = load_trainer_model(models["llama"], "float32").eval().to(torch.bfloat16)
    batch = right_padded([runs[0].prompt + runs[0].tokens], 64)
    with pytest.raises(ValueError, match=r"inv_freq is torch.bfloat16.*from_pretrained\(\.\.\., dtype=\.\.\.\)"):
        _trainer(loaded, batch, runs)
    monkeypatch.setattr(invariant, "_refuse_rounded_rotary", lambda module: None)  # the control
    assert _trainer(loaded, batch, runs) != [runs[0].log_probs]


def test_autocast_is_refused(models):
    model = load_trainer_model(models["llama"], "float32").eval()
    with torch.autocast(model.device.type, dtype=torch.bfloat16), pytest.raises(RuntimeError, match="load the model in the engine"):
        _trainer(model, right_padded([[5, 6, 7, 8]], 8), [])
