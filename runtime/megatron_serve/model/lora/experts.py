"""LoRA on mixture-of-experts experts, as PEFT writes it for ``transformers`` 5 models.

``transformers`` 5 holds a layer's experts as two stacked parameters, ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]`` (Mixtral, Qwen2-MoE and Qwen3-MoE alike; this
model's :class:`~.moe.FusedExperts` has the same layout), so PEFT reaches them with ``target_parameters``, not
``target_modules``: one LoRA pair per parameter covering every expert, ``lora_A`` ``[r * E, in]`` (expert
``e``'s rows ``e * r .. e * r + r - 1``) and ``lora_B`` ``[out, r * E]`` (expert ``e``'s columns
``e, e + E, ...``: PEFT reshapes it to ``[out, r, E]``). When both parameters are targeted PEFT wraps the
module twice, so the first in module order (``gate_up_proj``) is saved under ``experts.base_layer.`` and
the other under ``experts.``; one alone is ``experts.``.
"""

from __future__ import annotations

import re

import torch

from ..config import ModelConfig

#: This model's names of the expert projections, in module order (the order of PEFT's wrapping).
EXPERT_PROJECTIONS = ("experts.gate_up_proj", "experts.down_proj")
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)\.lora_(A|B)\.weight")


def expert_targets(target_parameters: object) -> tuple[str, ...] | None:
    """The expert projections ``target_parameters`` names, in module order; None when it names anything else."""
    if not target_parameters:
        return ()
    if not isinstance(target_parameters, (list, tuple, set)):
        return None
    named = set()
    for target in target_parameters:
        found = [p for p in EXPERT_PROJECTIONS if isinstance(target, str) and (target == p or target.endswith("." + p))]
        if not found:
            return None
        named.add(found[0])
    return tuple(p for p in EXPERT_PROJECTIONS if p in named)


def expert_key(key: str, targets: tuple[str, ...]) -> tuple[int, str, str] | None:
    """``(layer, projection, "A" or "B")`` of a PEFT expert tensor name under ``targets``; None when it is not one."""
    match = _KEY.fullmatch(key)
    if match is None or not targets:
        return None
    depth = match[2].count(".base_layer")
    if depth >= len(targets):
        return None
    return int(match[1]), targets[len(targets) - 1 - depth], match[3]


def expert_shape(config: ModelConfig, layer: int, projection: str) -> tuple[int, int, int] | None:
    """``(experts, out_features, in_features)`` of one expert projection; None where the layer has no experts."""
    moe = config.moe
    if moe is None or not moe.is_sparse(layer):
        return None
    hidden, inner = config.hidden_size, moe.expert_intermediate_size
    if projection == EXPERT_PROJECTIONS[0]:
        return moe.num_experts, 2 * inner, hidden
    return moe.num_experts, hidden, inner


def per_expert(a: torch.Tensor, b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ``lora_A [r * E, in]``, ``lora_B [out, r * E]`` as ``[E, r, in]`` and ``[E, out, r]``."""
    rank = a.shape[0] // experts
    return a.reshape(experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, experts).permute(2, 0, 1).contiguous()
