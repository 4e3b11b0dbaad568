"""Trainer side of ``--batch-invariant``: compute log probs with the engine's arithmetic, bit for bit.

A trainer that imports this module (it needs ``torch`` only, not the server's dependencies) gets:

* :func:`batch_invariant`, a context manager under which ``nn.Linear``, SiLU and the rotary
  embedding's ``cos``/``sin`` use the engine's batch-invariant ops (:mod:`megatron_kernels.invariant`);
* the attention implementation ``"megatron_invariant"``, registered with ``transformers`` on import
  when ``transformers`` is installed: keys reduced in fixed blocks from position 0, the engine's
  attention for prefill, decode and prefix-cache hits alike (on CUDA the engine's Triton kernel,
  ``triton_invariant_attention.dense_attention``, which needs ``triton``);
* :func:`use_invariant_norms`, which routes a model's RMSNorm modules through the engine's RMSNorm:
  the same bits as ``transformers``' own on CPU, the engine's one-row-per-program Triton kernel on a
  GPU (where PyTorch's reductions pick their split by the row count, and the engine does not use them).

A ``transformers`` Llama-family or Qwen3 model loaded from the engine's checkpoint in the same dtype
with ``attn_implementation="megatron_invariant"`` and run under ``batch_invariant()`` over prompt +
completion gives, with ``torch.log_softmax(logits.float(), -1)``, exactly the log prob the engine
reported for each completion token (docs/batch-invariance.md).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
from megatron_kernels.invariant import InvariantMode, rms_norm
from megatron_kernels.invariant_attention import attention
from megatron_kernels.invariant_layout import BatchLayout, batch_layout

ATTENTION_NAME = "megatron_invariant"

__all__ = ["ATTENTION_NAME", "batch_invariant", "hf_attention", "use_invariant_norms"]


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Run this process's forward passes with the engine's batch-invariant op set. A model that cannot give
    the engine's bits is refused at its forward, with what to do: one cast after loading (its rotary
    embedding's ``inv_freq`` rounded to the cast's dtype, where the engine and a model loaded in that dtype
    keep float32)."""
    hook = torch.nn.modules.module.register_module_forward_pre_hook(_prepare_module)
    try:
        with InvariantMode():
            yield
    finally:
        hook.remove()


def _prepare_module(module: torch.nn.Module, args: tuple) -> None:
    _refuse_rounded_rotary(module)
    _recompute_in_the_mode(module)


def _refuse_rounded_rotary(module: torch.nn.Module) -> None:
    inv_freq = module._buffers.get("inv_freq")
    if inv_freq is not None and inv_freq.dtype != torch.float32:
        raise ValueError(
            f"{type(module).__name__}.inv_freq is {inv_freq.dtype}, but the engine computes rotary angles from "
            "float32 frequencies: the model was cast after loading (model.to(dtype) casts every buffer); load it "
            "in the engine's dtype instead, from_pretrained(..., dtype=...), which keeps inv_freq in float32")


def _recompute_in_the_mode(module: torch.nn.Module) -> None:
    """A ``transformers`` layer under gradient checkpointing recomputes its forward in the backward pass, where
    the autograd engine runs without this thread's torch-function modes: its checkpoint function is wrapped
    once so that a forward run in the mode is recomputed in it (the same saved tensors, the same gradients)."""
    checkpoint = module.__dict__.get("_gradient_checkpointing_func")
    if checkpoint is not None and not isinstance(checkpoint, _ModeCheckpoint):
        module._gradient_checkpointing_func = _ModeCheckpoint(checkpoint)


def _in_the_mode() -> bool:
    return any(isinstance(mode, InvariantMode) for mode in torch.overrides._get_current_function_mode_stack())


class _ModeCheckpoint:
    """A checkpoint function whose recompute runs in :class:`InvariantMode` when its forward did."""

    def __init__(self, checkpoint: Callable) -> None:
        self.checkpoint = checkpoint

    def __call__(self, function: Callable, *args, **kwargs):
        if not _in_the_mode():
            return self.checkpoint(function, *args, **kwargs)

        def in_the_mode(*inner, **inner_kwargs):
            if _in_the_mode():  # the forward itself
                return function(*inner, **inner_kwargs)
            with InvariantMode():  # the recompute, from the backward pass
                return function(*inner, **inner_kwargs)
        return self.checkpoint(in_the_mode, *args, **kwargs)


def use_invariant_norms(model: torch.nn.Module) -> int:
    """Route every RMSNorm module of a ``transformers`` model (a module named ``...RMSNorm`` with
    ``variance_epsilon``) through the engine's RMSNorm; returns how many. Needed for parity on a GPU."""
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = functools.partial(_invariant_norm, module)
            count += 1
    return count


def _invariant_norm(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, module.weight, module.variance_epsilon)


def hf_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 position_ids: torch.Tensor | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """The ``transformers`` attention interface over the engine's attention (``megatron_invariant``).

    ``query`` ``[B, Hq, S, D]``, ``key``/``value`` ``[B, Hkv, L, D]``, causal. Over a whole batch (``S == L``,
    a trainer's forward) each row may hold padding on either side (the 2D ``attention_mask``, passed as-is:
    this name shares flash-attention's mask function) and several packed sequences (``position_ids``
    restarting at 0, or ``cu_seq_lens_q``): :func:`~megatron_kernels.invariant_layout.batch_layout` finds each
    token's sequence, and every sequence attends over its own keys from its position 0, as the engine's
    request does. With a cache (``S < L``, generation) each row is one sequence, the queries its last ``S``
    tokens.
    """
    if dropout:
        raise ValueError(f"{ATTENTION_NAME} attention has no dropout (got {dropout}): run the model in eval "
                         "mode or with attention_dropout=0")
    if torch.is_autocast_enabled(query.device.type):
        raise RuntimeError(f"{ATTENTION_NAME} under torch.autocast: autocast computes in another dtype than the "
                           "engine (float32 norms and residuals around bfloat16 GEMMs); load the model in the "
                           "engine's dtype (from_pretrained(..., dtype=...)) and run without autocast")
    batch, heads, length, dim = query.shape
    keys_length = key.shape[2]
    scale = scaling if scaling is not None else dim**-0.5
    if length == keys_length:
        layout = batch_layout(batch, length, attention_mask, position_ids, cu_seq_lens_q, query.device)
    else:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(f"{ATTENTION_NAME} attention over a cache takes right-padded rows only (the mask has "
                             "padding): run the trainer's forward over whole sequences, without a cache")
        layout = _cached_layout(batch, length, keys_length, query.device)
    rows = query.transpose(1, 2).reshape(batch * length, heads, dim)
    if query.is_cuda:  # the engine's Triton kernel over a paged view of this K/V: the engine's bits on this GPU
        from megatron_kernels.triton_invariant_attention import dense_attention  # noqa: PLC0415 - needs triton
        keys, values = (_sequences(cache, layout).transpose(0, 1) for cache in (key, value))
        out = dense_attention(rows, keys, values, layout.sequence, layout.positions, scale)
    else:
        keys, values = (_sequences(cache, layout) for cache in (key, value))
        out = attention(rows, keys, values, layout.sequence, layout.positions, scale)
    return out.view(batch, length, heads, dim), None


def _cached_layout(batch: int, length: int, keys_length: int, device: torch.device) -> BatchLayout:
    """One sequence per row, its queries the last ``length`` of its ``keys_length`` tokens."""
    sequence = torch.arange(batch, device=device).repeat_interleave(length)
    positions = (torch.arange(length, device=device) + keys_length - length).repeat(batch)
    keys = torch.arange(batch * keys_length, device=device).view(batch, keys_length)
    return BatchLayout(sequence, positions, keys)


def _sequences(cache: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
    """``[B, Hkv, L, D]`` to ``[Hkv, sequences, longest, D]``: each sequence's keys (or values) in order."""
    batch, kv_heads, length, dim = cache.shape
    tokens = cache.transpose(1, 2).reshape(batch * length, kv_heads, dim)
    return tokens[layout.keys].permute(2, 0, 1, 3)


def _register_with_transformers() -> None:
    try:
        from transformers import AttentionInterface  # noqa: PLC0415 - optional: a trainer may go without it
    except ImportError:
        return
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask  # noqa: PLC0415

    AttentionInterface.register(ATTENTION_NAME, hf_attention)
    # flash-attention's mask function hands the attention the 2D padding mask as it is (None without padding)
    AttentionMaskInterface.register(ATTENTION_NAME, flash_attention_mask)


_register_with_transformers()
