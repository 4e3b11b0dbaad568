"""A Qwen3-MoE block's arithmetic as ``transformers`` computes it (the engine's in the mode), for trainers whose
own mixture-of-experts layers round otherwise (Megatron-core's router takes the top-k of the logits before its
softmax; grouped GEMMs reduce in their own order): the recipes of :mod:`.invariant_megatron_core` and
:mod:`.invariant_torchtitan` put it in their models' expert layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def routed_experts(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int
                   ) -> torch.Tensor:
    """``x`` ``[..., hidden]`` through the experts its router picks: ``router`` ``[experts, hidden]``, each expert's
    fused ``gate_up`` ``[2 * ffn, hidden]`` (gate rows, then up rows) and ``down`` ``[hidden, ffn]``.

    The router's probabilities are a float32 softmax; ``top_k`` are kept, renormalised (Qwen3-MoE's
    ``norm_topk_prob``) and rounded to the model dtype; each expert's tokens go through ``F.linear`` (the mode's GEMM
    under ``batch_invariant()``) in ascending expert id order, and a token's scaled outputs are added in that order
    in the model dtype. Differentiable."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    logits = F.linear(x, router)
    weights, chosen = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype)
    out = torch.zeros_like(x)
    for expert in torch.unique(chosen).tolist():  # ascending ids
        token, slot = torch.where(chosen == expert)
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * weights[token, slot, None]
        out = out.index_add(0, token, y.to(out.dtype))
    return out.view(shape)


def stacked_experts(state: dict[str, torch.Tensor], prefix: str, experts: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``router``, ``gate_up`` and ``down`` of :func:`routed_experts` from a Hugging Face Qwen3-MoE layer's tensors
    (``prefix``: ``"model.layers.3.mlp."``; per-expert ``gate_proj``/``up_proj``/``down_proj``)."""
    names = [f"{prefix}experts.{expert}." for expert in range(experts)]
    gate_up = torch.stack([torch.cat([state[name + "gate_proj.weight"], state[name + "up_proj.weight"]])
                           for name in names])
    return state[prefix + "gate.weight"], gate_up, torch.stack([state[name + "down_proj.weight"] for name in names])
