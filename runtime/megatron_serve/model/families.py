"""The model families this engine serves: one table from a checkpoint's architecture to what differs.

Every family is a Llama-style decoder; a family says which attention details it has (q/k/v biases,
q/k norm, how its ``sliding_window`` key is read) and, for mixture-of-experts families, how its
``config.json`` describes the experts. A new family is one row in ``ARCHITECTURES``.
Vision-language checkpoints wrap one of these decoders: their table (architecture -> vision kind,
text model type -> decoder row here) is in :mod:`.vision_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .errors import UnsupportedModelError


@dataclass(frozen=True)
class MoEConfig:
    """The experts of a mixture-of-experts decoder.

    Router: softmax over ``num_experts`` logits, the ``top_k`` largest, renormalised to sum to one
    when ``norm_topk_prob``. ``shared_expert_intermediate_size`` > 0 adds an always-on expert whose
    output is scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE). Layers not in
    ``sparse_layers`` keep a dense MLP of the model's ``intermediate_size``.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    shared_expert_intermediate_size: int = 0

    def is_sparse(self, layer_index: int) -> bool:
        return layer_index in self.sparse_layers


def _checked(moe: MoEConfig) -> MoEConfig:
    if moe.num_experts < 1 or not 1 <= moe.top_k <= moe.num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok={moe.top_k} must be between 1 and the number of experts ({moe.num_experts})")
    if moe.num_experts > 65536:
        raise UnsupportedModelError(f"{moe.num_experts} experts: at most 65536 are supported")
    return moe


def _num_experts(raw: dict[str, Any]) -> int:
    """Qwen configs name it ``num_experts``; ``transformers`` 5 writes ``num_local_experts`` for all of them."""
    return int(raw["num_experts"] if raw.get("num_experts") is not None else raw["num_local_experts"])


def mixtral_experts(raw: dict[str, Any]) -> MoEConfig:
    """Mixtral: every layer sparse, experts of ``intermediate_size``, top-k always renormalised."""
    return _checked(MoEConfig(
        num_experts=_num_experts(raw), top_k=int(raw.get("num_experts_per_tok", 2)),
        expert_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True,
        sparse_layers=tuple(range(int(raw["num_hidden_layers"]))),
    ))


def qwen_experts(raw: dict[str, Any], shared_expert: bool) -> MoEConfig:
    """Qwen2-MoE / Qwen3-MoE: layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0`` and it is
    not in ``mlp_only_layers`` (the rule of their reference implementation)."""
    num_experts = _num_experts(raw)
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(int(raw["num_hidden_layers"]))
                   if num_experts > 0 and i not in dense and (i + 1) % step == 0)
    return _checked(MoEConfig(
        num_experts=num_experts, top_k=int(raw.get("num_experts_per_tok", 1)),
        expert_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)), sparse_layers=layers,
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0) if shared_expert else 0,
    ))


@dataclass(frozen=True)
class Family:
    """What one architecture's decoder differs in."""

    name: str
    qkv_bias: bool = False  # biases on q/k/v (Qwen2)
    qk_norm: bool = False  # RMSNorm of every query/key head (Qwen3)
    window_needs_flag: bool = False  # ``sliding_window`` counts only with ``use_sliding_window`` (Qwen)
    experts: Callable[[dict[str, Any]], MoEConfig] | None = None  # reads the experts of an MoE family


ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama"),
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True, window_needs_flag=True),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True, window_needs_flag=True),
    "MixtralForCausalLM": Family("mixtral", experts=mixtral_experts),
    "Qwen2MoeForCausalLM": Family("qwen2_moe", qkv_bias=True, window_needs_flag=True,
                                  experts=lambda raw: qwen_experts(raw, shared_expert=True)),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", qk_norm=True, window_needs_flag=True,
                                  experts=lambda raw: qwen_experts(raw, shared_expert=False)),
}
