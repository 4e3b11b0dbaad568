"""Trainer side of ``--batch-invariant``: compute log probs with the engine's arithmetic, bit for bit.

A trainer that imports this module (it needs ``torch`` only, not the server's dependencies) gets:

* :func:`batch_invariant`, a context manager under which ``nn.Linear``, SiLU and the rotary
  embedding's ``cos``/``sin`` use the engine's batch-invariant ops (:mod:`megatron_kernels.invariant`);
* the attention implementation ``"megatron_invariant"``, registered with ``transformers`` on import
  when ``transformers`` is installed: keys reduced in fixed blocks from position 0, the engine's
  attention for prefill, decode and prefix-cache hits alike.

A ``transformers`` Llama-family or Qwen3 model loaded from the engine's checkpoint in the same dtype
with ``attn_implementation="megatron_invariant"`` and run under ``batch_invariant()`` over prompt +
completion gives, with ``torch.log_softmax(logits.float(), -1)``, exactly the log prob the engine
reported for each completion token (docs/batch-invariance.md).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from megatron_kernels.invariant import InvariantMode, attention

ATTENTION_NAME = "megatron_invariant"

__all__ = ["ATTENTION_NAME", "batch_invariant", "hf_attention"]


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Run this process's forward passes with the engine's batch-invariant op set."""
    with InvariantMode():
        yield


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
    out = attention(rows, key.transpose(1, 2), value.transpose(1, 2), sequence, positions, scale)
    return out.view(batch, length, heads, dim), None


def _register_with_transformers() -> None:
    try:
        from transformers import AttentionInterface  # noqa: PLC0415 - optional: a trainer may go without it
    except ImportError:
        return
    AttentionInterface.register(ATTENTION_NAME, hf_attention)


_register_with_transformers()
