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
from typing import Iterator

import torch
from megatron_kernels.invariant import InvariantMode, rms_norm
from megatron_kernels.invariant_attention import attention

ATTENTION_NAME = "megatron_invariant"

__all__ = ["ATTENTION_NAME", "batch_invariant", "hf_attention", "use_invariant_norms"]


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Run this process's forward passes with the engine's batch-invariant op set."""
    with InvariantMode():
        yield


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
                 **kwargs) -> tuple[torch.Tensor, None]:
    """The ``transformers`` attention interface over the engine's attention (``megatron_invariant``).

    ``query`` ``[B, Hq, S, D]``, ``key``/``value`` ``[B, Hkv, L, D]``: causal, every sequence starting
    at position 0 (right padding only: a row's tokens never see the padding after them). The mask is
    not read: this name has no mask function, so ``transformers`` passes none.
    """
    if dropout:
        raise ValueError(f"{ATTENTION_NAME} attention has no dropout (got {dropout}): run the model in eval "
                         "mode or with attention_dropout=0")
    batch, heads, length, dim = query.shape
    rows = query.transpose(1, 2).reshape(batch * length, heads, dim)
    sequence = torch.arange(batch, device=query.device).repeat_interleave(length)
    positions = (torch.arange(length, device=query.device) + key.shape[2] - length).repeat(batch)
    scale = scaling if scaling is not None else dim**-0.5
    if query.is_cuda:  # the engine's Triton kernel over a paged view of this K/V: the engine's bits on this GPU
        from megatron_kernels.triton_invariant_attention import dense_attention  # noqa: PLC0415 - needs triton
        out = dense_attention(rows, key, value, sequence, positions, scale)
    else:
        out = attention(rows, key.transpose(0, 1), value.transpose(0, 1), sequence, positions, scale)
    return out.view(batch, length, heads, dim), None


def _register_with_transformers() -> None:
    try:
        from transformers import AttentionInterface  # noqa: PLC0415 - optional: a trainer may go without it
    except ImportError:
        return
    AttentionInterface.register(ATTENTION_NAME, hf_attention)


_register_with_transformers()
