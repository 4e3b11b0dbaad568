"""The trainer side of ``--batch-invariant`` for TorchTitan: a ``Llama3Model`` (or ``Qwen3Model``) whose log probs
are the engine's.

TorchTitan's Llama computes another way than the engine in three places: its rotary embedding (``ComplexRoPE``
multiplies complex numbers; ``CosSinRoPE`` rotates in float32 from a table computed at build time, where
``transformers`` and the engine rotate in the model dtype), its norms (``torch.nn.RMSNorm``) and its inner attention
(flex attention over ``BlockMask``s, or varlen flash attention); its Qwen3's ``MoE`` in a fourth (grouped GEMMs).
:func:`config_from_hf` builds the model's configuration with the mode's modules in those places, the rest
TorchTitan's own (``Linear`` is an ``nn.Linear``, its SwiGLU ``F.silu``: both reach the mode's ops under
``batch_invariant()``):

* :class:`InvariantRoPE`: angles of float32 frequencies, ``cos``/``sin`` through the mode's lane-wise ops, cast to
  the model dtype, then ``x * cos + rotate_half(x) * sin`` in it, as ``transformers`` computes it;
* :class:`InvariantRMSNorm`: RMSNorm as ``transformers`` writes it (:func:`~.invariant.rms_norm`);
* :class:`InvariantAttention`: the inner attention through :func:`~.invariant_attention.attention`, over the
  sequences that :func:`attention_masks` finds in a batch (the role of ``model.get_attention_masks``: one
  sequence per row without it; packed documents by ``positions`` restarting at 0, right or left padding by a 2D
  padding mask);
* :class:`InvariantExperts` for Qwen3-MoE: :func:`~.invariant_experts.routed_experts`.

:func:`load_hf_checkpoint` loads the checkpoint the engine serves (separate ``wq``/``wk``/``wv``: the rotate-half
rotary takes the Hugging Face row order as it is, without the permutation ``Llama3StateDictAdapter`` makes for
the complex one). Llama-family, Qwen3 and Qwen3-MoE checkpoints; needs ``torchtitan`` (0.3) and what its model
package imports (``spmd_types``, ``tyro``), not its trainer's dependencies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torchtitan.models.common import Embedding, FeedForward, Linear
from torchtitan.models.common.attention import GQAttention, QKVLinear
from torchtitan.models.common.rope import RoPE
from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock
from torchtitan.models.qwen3 import Qwen3Model, Qwen3TransformerBlock
from torchtitan.protocols.module import Module

from .invariant import rms_norm
from .invariant_attention import DensePlan, attention, plan_dense
from .invariant_checkpoint import hf_state_dict
from .invariant_experts import routed_experts, stacked_experts
from .invariant_layout import BatchLayout, batch_layout

__all__ = ["InvariantAttention", "InvariantExperts", "InvariantMasks", "InvariantRMSNorm", "InvariantRoPE",
           "attention_masks", "config_from_hf", "load_hf_checkpoint"]


class InvariantRMSNorm(Module):
    """RMSNorm as ``transformers`` writes it (float32 statistics, cast, then the weight)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        normalized_shape: int
        eps: float = 1e-6

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.eps = config.eps
        self.weight = torch.nn.Parameter(torch.ones(config.normalized_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class InvariantRoPE(RoPE):
    """Rotary embedding as ``transformers`` applies it, for ``[batch, length, heads, head_dim]`` queries and keys.

    The frequencies are made in float32 at each call (a few dozen values), not kept in a buffer: a buffer would be
    rounded by ``model.to(torch.bfloat16)``, where the engine keeps them in float32."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoPE.Config):
        pass

    def __init__(self, config: Config) -> None:
        if config.scaling != "none":
            raise ValueError(f"InvariantRoPE: rope scaling {config.scaling!r} is not handled (the engine's default "
                             "rotary only)")
        super().__init__(config)

    def _precompute_cache(self) -> torch.Tensor:
        return torch.empty(0)

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        return None

    def forward(self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, _, dim = query.shape
        device = query.device
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        inv_freq = 1.0 / (self.config.theta ** exponents)  # transformers' default rotary
        if positions is None:
            positions = torch.arange(length, device=device)[None]
        angles = positions.to(device=device, dtype=torch.float32)[..., None] * inv_freq  # [1 or batch, length, dim/2]
        both = torch.cat((angles, angles), dim=-1)[:, :, None, :]
        cos, sin = both.cos().to(query.dtype), both.sin().to(query.dtype)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass
class InvariantMasks:
    """The sequences of one ``[batch, length]`` call (:func:`attention_masks`) and the attention plan, made by the
    first layer and reused by the others (the same for every layer of the forward)."""

    layout: BatchLayout
    plans: dict[int, DensePlan] = field(default_factory=dict)  # per query heads per KV head


def attention_masks(batch: int, length: int, positions: torch.Tensor | None = None,
                    padding_mask: torch.Tensor | None = None, device: torch.device | str = "cpu") -> InvariantMasks:
    """The ``attention_masks`` to pass to the model's forward for a ``[batch, length]`` batch: packed documents
    where ``positions`` restarts at 0 (TorchTitan's per-document positions), padding where the 2D
    ``padding_mask`` is 0 (each sequence must start at position 0, as the engine's do)."""
    return InvariantMasks(batch_layout(batch, length, padding_mask, positions, None, torch.device(device)))


class InvariantAttention(Module):
    """Inner attention through :func:`~.invariant_attention.attention` (keys in fixed blocks from key 0), the
    engine's arithmetic; ``attention_masks``: :func:`attention_masks`'s, or ``None`` for one sequence per row."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                attention_masks: InvariantMasks | None = None, scale: float | None = None, enable_gqa: bool = False,
                is_causal: bool = True, **kwargs) -> torch.Tensor:
        """``q`` ``[B, L, Hq, D]``, ``k``/``v`` ``[B, L, Hkv, D]``; returns ``[B, L, Hq, D]``."""
        if not is_causal:
            raise ValueError("InvariantAttention is causal")
        if attention_masks is not None and not isinstance(attention_masks, InvariantMasks):
            raise TypeError(f"InvariantAttention takes megatron_kernels.invariant_torchtitan.attention_masks(...), "
                            f"got {type(attention_masks).__name__}")
        batch, length, heads, dim = q.shape
        kv_heads = k.shape[2]
        masks = attention_masks or attention_masks_for_rows(batch, length, q.device)
        layout = masks.layout
        group_heads = heads // kv_heads
        scale = scale if scale is not None else dim**-0.5
        rows = q.reshape(batch * length, heads, dim)
        keys, values = (cache.reshape(batch * length, kv_heads, dim)[layout.keys] for cache in (k, v))
        if q.is_cuda:  # the engine's Triton kernel, as the transformers recipe runs it on a GPU
            from .triton_invariant_attention import dense_attention  # noqa: PLC0415 - needs triton
            keys, values = (cache.permute(0, 2, 1, 3) for cache in (keys, values))  # [sequences, Hkv, longest, D]
            out = dense_attention(rows, keys, values, layout.sequence, layout.positions, scale)
            return out.view(batch, length, heads, dim)
        keys, values = (cache.permute(2, 0, 1, 3) for cache in (keys, values))  # [Hkv, sequences, longest, D]
        plan = masks.plans.get(group_heads)
        if plan is None:
            plan = masks.plans[group_heads] = plan_dense(layout.sequence, layout.positions, keys.shape[1],
                                                         keys.shape[2], group_heads, q.device)
        out = attention(rows, keys, values, layout.sequence, layout.positions, scale, plan)
        return out.view(batch, length, heads, dim)


def attention_masks_for_rows(batch: int, length: int, device: torch.device) -> InvariantMasks:
    """One sequence per row, from position 0."""
    return attention_masks(batch, length, device=device)


class InvariantExperts(Module):
    """A Qwen3-MoE layer's experts: :func:`~.invariant_experts.routed_experts` (its block as ``transformers``
    computes it) over ``router`` ``[experts, dim]``, ``gate_up`` ``[experts, 2 * hidden, dim]`` and ``down``
    ``[experts, dim, hidden]``, in the place of TorchTitan's ``MoE`` (whose grouped GEMMs and router round their
    own way)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        hidden_dim: int
        num_experts: int
        top_k: int

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.top_k = config.top_k
        experts, dim, hidden = config.num_experts, config.dim, config.hidden_dim
        self.router = torch.nn.Parameter(torch.empty(experts, dim))
        self.gate_up = torch.nn.Parameter(torch.empty(experts, 2 * hidden, dim))
        self.down = torch.nn.Parameter(torch.empty(experts, dim, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return routed_experts(x, self.router, self.gate_up, self.down, self.top_k)


def config_from_hf(model_dir: str | Path) -> Llama3Model.Config | Qwen3Model.Config:
    """The TorchTitan model configuration of a checkpoint, with the mode's rotary, norms, inner attention (and
    experts): a ``Llama3Model.Config`` for a Llama-family one, a ``Qwen3Model.Config`` for Qwen3 (its query/key
    norms) and Qwen3-MoE (:class:`InvariantExperts` in every layer). Build it with ``.build()``, load the weights
    with :func:`load_hf_checkpoint` and cast the model to the engine's dtype (the rotary frequencies stay
    float32)."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise ValueError("rope scaling is not handled (the engine's default rotary only)")
    qwen3, experts = hf.get("model_type") in ("qwen3", "qwen3_moe"), _experts(hf)
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads", heads)
    head_dim = hf.get("head_dim") or dim // heads
    eps, hidden, vocab = hf["rms_norm_eps"], hf["intermediate_size"], hf["vocab_size"]
    theta = hf.get("rope_theta") or rope.get("rope_theta", 10000.0)

    def norm(size: int) -> InvariantRMSNorm.Config:
        return InvariantRMSNorm.Config(normalized_shape=size, eps=eps)

    def linear(inputs: int, outputs: int, bias: bool = False) -> Linear.Config:
        return Linear.Config(in_features=inputs, out_features=outputs, bias=bias)

    bias = bool(hf.get("attention_bias", False))
    attention = GQAttention.Config(
        n_heads=heads, n_kv_heads=kv_heads, dim=dim, head_dim=head_dim,
        qkv_linear=QKVLinear.Config(head_dim=head_dim, wq=linear(dim, heads * head_dim, bias),
                                    wkv=linear(dim, kv_heads * head_dim, bias)),
        wo=linear(heads * head_dim, dim), qk_norm=norm(head_dim) if qwen3 else None,
        inner_attention=InvariantAttention.Config(),
        rope=InvariantRoPE.Config(dim=head_dim, max_seq_len=hf.get("max_position_embeddings", 4096), theta=theta))
    if experts:
        mlp = {"moe": InvariantExperts.Config(dim=dim, hidden_dim=hf["moe_intermediate_size"], num_experts=experts,
                                              top_k=hf["num_experts_per_tok"])}
    else:
        mlp = {"feed_forward": FeedForward.Config(w1=linear(dim, hidden), w2=linear(hidden, dim),
                                                  w3=linear(dim, hidden))}
    block, model = (Qwen3TransformerBlock, Qwen3Model) if qwen3 else (Llama3TransformerBlock, Llama3Model)
    layer = block.Config(attention_norm=norm(dim), ffn_norm=norm(dim), attention=attention, **mlp)
    return model.Config(
        dim=dim, vocab_size=vocab, tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=norm(dim), lm_head=linear(dim, vocab), layers=[layer] * hf["num_hidden_layers"],
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)))


def _experts(hf: dict) -> int:
    """The experts of a Qwen3-MoE checkpoint (0 for a dense one); another mixture of experts is refused."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if experts and (hf.get("model_type") != "qwen3_moe" or not hf.get("norm_topk_prob", False)
                    or hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
        raise ValueError("the recipe's mixture of experts is Qwen3-MoE's: every layer sparse, norm_topk_prob true")
    return experts


_LAYER_NAMES = {"self_attn.q_proj": "attention.qkv_linear.wq", "self_attn.k_proj": "attention.qkv_linear.wk",
                "self_attn.v_proj": "attention.qkv_linear.wv", "self_attn.o_proj": "attention.wo",
                "self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm",
                "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
                "mlp.down_proj": "feed_forward.w2",
                "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}


def hf_to_torchtitan(state: dict[str, torch.Tensor], experts: int = 0) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama/Qwen3/Qwen3-MoE state dict under TorchTitan's names (rows as they are; each MoE layer's
    ``experts`` stacked for :class:`InvariantExperts`)."""
    out = {}
    moe_layers = {name.split(".")[2] for name in state if ".mlp.experts." in name}
    for layer in moe_layers:
        router, gate_up, down = stacked_experts(state, f"model.layers.{layer}.mlp.", experts)
        out.update({f"layers.{layer}.moe.router": router, f"layers.{layer}.moe.gate_up": gate_up,
                    f"layers.{layer}.moe.down": down})
    for name, tensor in state.items():
        if ".mlp.experts." in name or (name.endswith(".mlp.gate.weight") and name.split(".")[2] in moe_layers):
            continue
        if name == "model.embed_tokens.weight":
            out["tok_embeddings.weight"] = tensor
        elif name == "model.norm.weight":
            out["norm.weight"] = tensor
        elif name == "lm_head.weight":
            out[name] = tensor
        elif name.startswith("model.layers.") and not name.endswith("rotary_emb.inv_freq"):
            layer, rest = name[len("model.layers."):].split(".", 1)
            module, _, suffix = rest.rpartition(".")
            if module not in _LAYER_NAMES:
                raise ValueError(f"{name}: no TorchTitan Llama weight takes it")
            out[f"layers.{layer}.{_LAYER_NAMES[module]}.{suffix}"] = tensor
        else:
            raise ValueError(f"{name}: no TorchTitan Llama weight takes it")
    return out


def load_hf_checkpoint(model: torch.nn.Module, model_dir: str | Path) -> torch.nn.Module:
    """Load the checkpoint the engine serves (its ``*.safetensors``) into ``model``, strictly. Returns ``model``."""
    state = hf_state_dict(model_dir)
    layer = model.layers["0"]
    mapped = hf_to_torchtitan(state, layer.moe.router.shape[0] if getattr(layer, "moe_enabled", False) else 0)
    if model.enable_weight_tying:
        mapped.setdefault("lm_head.weight", mapped["tok_embeddings.weight"])
    model.load_state_dict(mapped, strict=True)
    return model
