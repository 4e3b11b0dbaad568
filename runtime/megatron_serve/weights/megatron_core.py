"""Cutting a Megatron-core trainer's tensor-parallel shards into Hugging Face-named pieces for ``WeightSender.send``.

Megatron-core fuses what Hugging Face checkpoints keep apart: ``linear_qkv`` holds, on each tensor-parallel rank,
its query groups one after another, each group its query heads then its key head then its value head;
``linear_fc1`` of a gated MLP holds the rank's gate rows then its up rows. A sender names pieces of the
checkpoint's tensors (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``), so these helpers cut a
rank's local fused tensor into those pieces, each with its :class:`~.shards.Shard` (where it lies in the full
tensor). Weights and biases alike: only dim 0 is cut.
"""

from __future__ import annotations

import torch

from .shards import Item, Shard


def tp_piece(name: str, local: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> Item:
    """A plain tensor-parallel shard: ``local`` is rank ``tp_rank``'s equal part of the full tensor along ``dim``
    (a column-parallel weight or a vocabulary: dim 0; a row-parallel weight: dim 1)."""
    full = list(local.shape)
    full[dim] *= tp_size
    offset = [0] * local.dim()
    offset[dim] = tp_rank * local.shape[dim]
    return name, local, Shard(tuple(full), tuple(offset))


def fused_qkv_pieces(prefix: str, local: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int,
                     tp_rank: int, tp_size: int, suffix: str = "weight") -> list[Item]:
    """``prefix`` + ``q_proj.`` / ``k_proj.`` / ``v_proj.`` + ``suffix`` pieces of rank ``tp_rank``'s Megatron-core
    ``linear_qkv`` shard (``prefix``: e.g. ``"model.layers.3.self_attn."``)."""
    if num_heads % num_kv_heads or num_kv_heads % tp_size:
        raise ValueError(f"fused_qkv_pieces needs query groups split evenly over ranks: {num_heads} heads, "
                         f"{num_kv_heads} key/value heads, tensor parallel {tp_size}")
    groups = num_kv_heads // tp_size
    per_group = num_heads // num_kv_heads
    rows = groups * (per_group + 2) * head_dim
    if local.shape[0] != rows:
        raise ValueError(f"a linear_qkv shard of {groups} query group(s) has {rows} rows, got {local.shape[0]}")
    grouped = local.reshape(groups, per_group + 2, head_dim, *local.shape[1:])
    rest = tuple(local.shape[1:])
    q = grouped[:, :per_group].reshape(groups * per_group * head_dim, *rest).contiguous()
    k = grouped[:, per_group].reshape(groups * head_dim, *rest).contiguous()
    v = grouped[:, per_group + 1].reshape(groups * head_dim, *rest).contiguous()
    zeros = (0,) * len(rest)
    return [
        (f"{prefix}q_proj.{suffix}", q, Shard((num_heads * head_dim, *rest), (tp_rank * q.shape[0], *zeros))),
        (f"{prefix}k_proj.{suffix}", k, Shard((num_kv_heads * head_dim, *rest), (tp_rank * k.shape[0], *zeros))),
        (f"{prefix}v_proj.{suffix}", v, Shard((num_kv_heads * head_dim, *rest), (tp_rank * v.shape[0], *zeros))),
    ]


def gate_up_pieces(prefix: str, local: torch.Tensor, *, tp_rank: int, tp_size: int,
                   suffix: str = "weight") -> list[Item]:
    """``prefix`` + ``gate_proj.`` / ``up_proj.`` + ``suffix`` pieces of rank ``tp_rank``'s Megatron-core
    ``linear_fc1`` shard of a gated MLP (``prefix``: e.g. ``"model.layers.3.mlp."``)."""
    if local.shape[0] % 2:
        raise ValueError(f"a gated linear_fc1 shard holds gate and up rows alike, got {local.shape[0]} rows")
    half = local.shape[0] // 2
    gate, up = local[:half].contiguous(), local[half:].contiguous()
    return [tp_piece(f"{prefix}gate_proj.{suffix}", gate, 0, tp_rank, tp_size),
            tp_piece(f"{prefix}up_proj.{suffix}", up, 0, tp_rank, tp_size)]
