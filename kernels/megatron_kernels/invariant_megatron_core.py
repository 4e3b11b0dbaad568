"""The trainer side of ``--batch-invariant`` for Megatron-core: a ``GPTModel`` whose log probs are the engine's.

Megatron-core's local layer spec (``get_gpt_layer_local_spec``) computes another way than the engine: its
``ColumnParallelLinear``/``RowParallelLinear`` multiply with ``torch.matmul`` inside their own autograd function
(which :func:`~.invariant_trainer.batch_invariant` does not reach), its RMSNorm is ``torch.nn.RMSNorm``, its core
attention a softmax over the whole score matrix, and on a CPU its forward stops at CUDA-only code (the rotary
embedding moves its frequencies to ``torch.cuda.current_device()``; the attention's scratch buffer is made there,
its default causal mask with ``device="cuda"``, and its dropout forks the CUDA RNG tracker even at 0).
:func:`get_gpt_invariant_block_spec` gives the decoder of the mode's modules instead:

* linears through the engine's GEMM (:func:`~.invariant.linear`, rows padded to whole tiles), tensor parallel
  size 1 only (a row-parallel all-reduce adds partial sums in an order of its own);
* RMSNorm as ``transformers`` computes it in the model dtype (:func:`~.invariant.rms_norm`), for the layers, the
  query/key norms and the final norm;
* the core attention through :func:`~.invariant_attention.attention` (keys in fixed blocks from position 0), over
  right-padded rows or Megatron-core's packed sequences (``packed_seq_params``, ``qkv_format="thd"``);
* a mixture of experts (:class:`InvariantMoE`) as ``transformers``' Qwen3-MoE block computes it: the router's
  softmax in float32, top-k, renormalised, rounded to the model dtype; each expert's tokens in ascending expert
  order through the engine's GEMM, added in that order (``index_add``) in the model dtype;
* Megatron-core's own rotary arithmetic, which is ``transformers``' (``x * cos + rotate_half(x) * sin`` in the
  model dtype, ``cos``/``sin`` of float32 angles through the mode's lane-wise ops), its frequencies kept on the
  model's device by :func:`use_invariant_gpt` (which also routes the output layer, built by ``GPTModel`` itself).

Run the forward under ``batch_invariant()`` (SiLU and ``cos``/``sin`` go through its lane-wise ops).
:func:`gpt_config_from_hf` and :func:`load_hf_checkpoint` build the ``TransformerConfig`` and load the weights of
the checkpoint the engine serves (q/k/v interleaved per query group, gate and up fused). Llama-family, Qwen3 and
Qwen3-MoE checkpoints; needs ``megatron-core`` (0.16).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .invariant import linear, rms_norm
from .invariant_attention import attention
from .invariant_checkpoint import hf_state_dict
from .invariant_experts import routed_experts, stacked_experts
from .invariant_layout import BatchLayout, batch_layout

__all__ = ["InvariantColumnParallelLinear", "InvariantCoreAttention", "InvariantMoE", "InvariantRMSNorm",
           "InvariantRowParallelLinear",
           "get_gpt_invariant_block_spec", "get_gpt_invariant_layer_spec", "gpt_config_from_hf", "load_hf_checkpoint",
           "use_invariant_gpt"]


def _invariant_forward_impl(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            **_: object) -> torch.Tensor:
    """A Megatron-core linear's ``_forward_impl`` (input ``[s, b, h]``) through the engine's GEMM: the gradient
    accumulation fusion, the async all-reduce and the sequence-parallel gather all have no work at TP=1."""
    return linear(input, weight, bias)


def _refuse_tensor_parallel(layer: torch.nn.Module) -> None:
    size = layer.tp_group.size() if layer.tp_group is not None else 1
    if size != 1:
        raise ValueError(f"{type(layer).__name__}: tensor parallel size {size}; the invariant spec runs at 1 (a "
                         "row-parallel all-reduce adds the ranks' partial sums in an order of its own)")


class _InvariantProduct:
    """What the invariant linears change of Megatron-core's two, the same for both: the product through the engine's
    GEMM (:func:`_invariant_forward_impl`), at tensor parallel size 1 only. First among the bases, before the
    Megatron-core linear it changes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _refuse_tensor_parallel(self)

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 - Megatron-core's name
        return _invariant_forward_impl(input, weight, *args, **kwargs)


class InvariantColumnParallelLinear(_InvariantProduct, ColumnParallelLinear):
    """``ColumnParallelLinear`` whose product is the engine's GEMM (:func:`~.invariant.linear`)."""


class InvariantRowParallelLinear(_InvariantProduct, RowParallelLinear):
    """``RowParallelLinear`` whose product is the engine's GEMM (:func:`~.invariant.linear`)."""


class InvariantRMSNorm(torch.nn.Module):
    """RMSNorm as ``transformers`` writes it (float32 statistics, cast, then the weight), built as Megatron-core
    builds its norms (``config``, ``hidden_size``, ``eps``)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class InvariantCoreAttention(MegatronModule):
    """Causal core attention through :func:`~.invariant_attention.attention` (keys reduced in fixed blocks from key
    0), the scale ``kv_channels ** -0.5`` as ``transformers`` and the engine write it. Each batch row is one
    sequence from position 0 (padding on the right changes no earlier token), or, with ``packed_seq_params``
    (``qkv_format="thd"``, Megatron-core's packed sequences), each ``cu_seqlens_q`` span is one."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"InvariantCoreAttention is causal; got {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"InvariantCoreAttention has no dropout (attention_dropout={dropout}): set it to 0")
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """``query`` ``[s, b, heads, d]``, ``key``/``value`` ``[s, b, groups, d]`` (``[t, heads or groups, d]``
        packed); returns ``[s, b, heads * d]`` (``[t, heads * d]``)."""
        if attention_bias is not None:
            raise ValueError("InvariantCoreAttention takes no attention_bias")
        if packed_seq_params is not None:
            layout = _packed_layout(packed_seq_params, query.shape[0], query.device)
            out = self._attend(query, key, value, layout.keys, layout.sequence, layout.positions)
            return out.reshape(query.shape[0], -1)
        length, batch, heads, dim = query.shape
        if attention_mask is not None and not _is_causal(attention_mask, length):
            raise ValueError("InvariantCoreAttention takes one sequence per batch row from position 0 (right padding): "
                             "pass attention_mask=None or the causal mask (True above the diagonal); pack sequences "
                             "with packed_seq_params instead")
        tokens = torch.arange(batch * length, device=query.device)
        out = self._attend(*(t.transpose(0, 1).reshape(batch * length, *t.shape[2:]) for t in (query, key, value)),
                           tokens.view(batch, length), tokens // length, tokens % length)
        return out.view(batch, length, heads * dim).transpose(0, 1)

    def _attend(self, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keys_of: torch.Tensor,
                sequence: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``rows`` ``[t, heads, d]``, ``key``/``value`` ``[t, groups, d]``; ``keys_of`` ``[sequences, longest]`` each
        sequence's token indices in order; ``sequence``/``positions`` per token."""
        if rows.is_cuda:  # the engine's Triton kernel, as the transformers recipe runs it on a GPU
            from .triton_invariant_attention import dense_attention  # noqa: PLC0415 - needs triton
            keys, values = (cache[keys_of].transpose(1, 2) for cache in (key, value))  # [sequences, groups, L, d]
            return dense_attention(rows, keys, values, sequence, positions, self.scale)
        keys, values = (cache[keys_of].permute(2, 0, 1, 3) for cache in (key, value))  # [groups, sequences, L, d]
        return attention(rows, keys, values, sequence, positions, self.scale)


def _packed_layout(params, tokens: int, device: torch.device) -> BatchLayout:
    """The sequences of Megatron-core's packed (``thd``) call: each ``cu_seqlens_q`` span from position 0."""
    if params.qkv_format != "thd":
        raise ValueError(f"InvariantCoreAttention packs sequences as qkv_format 'thd'; got {params.qkv_format!r}")
    offsets = params.cu_seqlens_q
    for other in (params.cu_seqlens_kv, params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded):
        if other is not None and not torch.equal(other.to(offsets.device), offsets):
            raise ValueError("InvariantCoreAttention takes packed sequences without padding between them: "
                             "cu_seqlens_kv and the padded offsets must equal cu_seqlens_q")
    return batch_layout(1, tokens, None, None, offsets, device)


class InvariantMoE(MegatronModule):
    """The MLP slot of a mixture-of-experts layer: :func:`~.invariant_experts.routed_experts` (Qwen3-MoE's block as
    ``transformers`` computes it) over ``router`` ``[experts, hidden]``, ``gate_up`` ``[experts, 2 * ffn, hidden]``
    and ``down`` ``[experts, hidden, ffn]`` (``config.moe_ffn_hidden_size``), ``config.moe_router_topk`` experts a
    token."""

    def __init__(self, config: TransformerConfig, submodules=None, **_: object) -> None:
        super().__init__(config=config)
        experts, ffn, hidden = config.num_moe_experts, config.moe_ffn_hidden_size, config.hidden_size
        self.top_k = config.moe_router_topk
        dtype = config.params_dtype
        self.router = torch.nn.Parameter(torch.empty(experts, hidden, dtype=dtype))
        self.gate_up = torch.nn.Parameter(torch.empty(experts, 2 * ffn, hidden, dtype=dtype))
        self.down = torch.nn.Parameter(torch.empty(experts, hidden, ffn, dtype=dtype))

    def forward(self, hidden_states: torch.Tensor, **_: object) -> tuple[torch.Tensor, None]:
        return routed_experts(hidden_states, self.router, self.gate_up, self.down, self.top_k), None


def _is_causal(mask: torch.Tensor, length: int) -> bool:
    """Whether Megatron-core's ``attention_mask`` (True: masked out; ``[b or 1, 1, s, s]``) is the plain causal one."""
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).triu(1)
    return mask.shape[-2:] == (length, length) and bool((mask.bool() == causal).all())


def get_gpt_invariant_layer_spec(qk_layernorm: bool = False, moe: bool = False) -> ModuleSpec:
    """``get_gpt_layer_local_spec(normalization="RMSNorm")``'s layer with the mode's modules: a dense MLP, or
    :class:`InvariantMoE` when ``moe``."""
    mlp = (ModuleSpec(module=InvariantMoE) if moe else
           ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=InvariantColumnParallelLinear,
                                                           linear_fc2=InvariantRowParallelLinear)))
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=InvariantRMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=InvariantColumnParallelLinear,
                    core_attention=InvariantCoreAttention,
                    linear_proj=InvariantRowParallelLinear,
                    q_layernorm=InvariantRMSNorm if qk_layernorm else IdentityOp,
                    k_layernorm=InvariantRMSNorm if qk_layernorm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=InvariantRMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def get_gpt_invariant_block_spec(config: TransformerConfig) -> ModuleSpec:
    """The decoder block for ``GPTModel(transformer_layer_spec=...)``: :func:`get_gpt_invariant_layer_spec`'s layer
    ``config.num_layers`` times (a mixture of experts in every layer when ``config.num_moe_experts``) and
    :class:`InvariantRMSNorm` as the final norm (a layer spec alone gets Megatron-core's default final norm)."""
    _refuse_fusions(config)
    layer = get_gpt_invariant_layer_spec(qk_layernorm=config.qk_layernorm, moe=bool(config.num_moe_experts))
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer] * config.num_layers, layer_norm=InvariantRMSNorm))


_FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion", "masked_softmax_fusion",
            "gradient_accumulation_fusion", "sequence_parallel")


def _refuse_fusions(config: TransformerConfig) -> None:
    on = [name for name in _FUSIONS if getattr(config, name, False)]
    if on:
        raise ValueError(f"TransformerConfig has {', '.join(on)} on: the fused kernels compute another way than the "
                         "engine; set them False")
    if config.normalization != "RMSNorm" or not config.gated_linear_unit or config.activation_func is not F.silu:
        raise ValueError("the invariant spec is a Llama-family decoder: normalization='RMSNorm', "
                         "gated_linear_unit=True, activation_func=F.silu")
    if config.num_moe_experts and (config.moe_shared_expert_intermediate_size or config.moe_layer_freq != 1
                                   or config.expert_model_parallel_size != 1):
        raise ValueError("the invariant spec's mixture of experts is Qwen3-MoE's: every layer, no shared expert, "
                         "expert parallel size 1")


def use_invariant_gpt(model: GPTModel) -> GPTModel:
    """Route what ``GPTModel`` builds itself, outside the layer spec, through the mode: the output layer's GEMM,
    and the rotary embedding's frequencies kept on their device (Megatron-core moves them to the current CUDA
    device when they are on the CPU). Returns ``model``."""
    _refuse_tensor_parallel(model.output_layer)
    model.output_layer._forward_impl = _invariant_forward_impl
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is not None:
        rotary.get_emb = functools.partial(_rotary_emb, rotary, model.embedding.word_embeddings)
    return model


def _rotary_emb(rotary: torch.nn.Module, embedding: torch.nn.Module, max_seq_len: int, offset: int = 0
                ) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` on the model's device (its ``inv_freq`` is a plain attribute, which
    ``model.to(device)`` leaves behind) and without its move to CUDA: ``[s, 1, 1, dim]`` float32 angles, both
    halves."""
    if rotary.rotary_interleaved:
        raise ValueError("rotary_interleaved=True: transformers' Llama rotates halves; set it False")
    rotary.inv_freq = rotary.inv_freq.to(embedding.weight.device)
    freqs = rotary.get_freqs_non_repeated(max_seq_len, offset)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def gpt_config_from_hf(model_dir: str | Path, dtype: torch.dtype) -> tuple[TransformerConfig, dict]:
    """The ``TransformerConfig`` of a Llama-family, Qwen3 or Qwen3-MoE checkpoint in ``dtype``, and the ``GPTModel``
    keyword arguments beside it (vocabulary, positions, rotary base, tied embeddings), with every fusion off and CPU
    initialisation (the weights come from :func:`load_hf_checkpoint`)."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    if hf.get("rope_scaling") or (hf.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        raise ValueError("rope scaling is not handled: Megatron-core's Llama 3 scaling rounds its own way")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    moe = {}
    if experts:
        if (hf.get("model_type") != "qwen3_moe" or not hf.get("norm_topk_prob", False) or hf.get("mlp_only_layers")
                or hf.get("decoder_sparse_step", 1) != 1):
            raise ValueError("the invariant spec's mixture of experts is Qwen3-MoE's: every layer sparse, "
                             "norm_topk_prob true")
        moe = {"num_moe_experts": experts, "moe_ffn_hidden_size": hf["moe_intermediate_size"],
               "moe_router_topk": hf["num_experts_per_tok"]}
    config = TransformerConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads", heads), kv_channels=head_dim,
        ffn_hidden_size=hf["intermediate_size"], normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=bool(hf.get("attention_bias", False)), qk_layernorm=hf.get("model_type") in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, **moe)
    rope_theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    kwargs = {"vocab_size": hf["vocab_size"], "max_sequence_length": hf.get("max_position_embeddings", 4096),
              "position_embedding_type": "rope", "rotary_base": rope_theta,
              "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False))}
    return config, kwargs


def hf_to_megatron_core(state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama/Qwen3/Qwen3-MoE state dict under ``GPTModel``'s names: each layer's q/k/v rows
    interleaved per query group (its query heads, then its key head, then its value head: the layout
    ``megatron_serve.weights.megatron_core.fused_qkv_pieces`` cuts), gate rows then up rows in ``linear_fc1`` (and
    in each expert's ``gate_up`` of :class:`InvariantMoE`)."""
    groups, dim = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // groups
    out = {"embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": state["model.norm.weight"]}
    if "lm_head.weight" in state:
        out["output_layer.weight"] = state["lm_head.weight"]
    for layer in range(config.num_layers):
        hf, mc = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        attn = hf + "self_attn."
        for suffix in ("weight", "bias"):
            if attn + f"q_proj.{suffix}" in state:
                q, k, v = (state[attn + f"{name}.{suffix}"] for name in ("q_proj", "k_proj", "v_proj"))
                rest = q.shape[1:]
                fused = torch.cat([q.reshape(groups, per_group, dim, *rest), k.reshape(groups, 1, dim, *rest),
                                   v.reshape(groups, 1, dim, *rest)], dim=1)
                out[mc + f"self_attention.linear_qkv.{suffix}"] = fused.reshape(-1, *rest)
        out[mc + "self_attention.linear_proj.weight"] = state[attn + "o_proj.weight"]
        out[mc + "input_layernorm.weight"] = state[hf + "input_layernorm.weight"]
        out[mc + "pre_mlp_layernorm.weight"] = state[hf + "post_attention_layernorm.weight"]
        if config.qk_layernorm:
            out[mc + "self_attention.q_layernorm.weight"] = state[attn + "q_norm.weight"]
            out[mc + "self_attention.k_layernorm.weight"] = state[attn + "k_norm.weight"]
        if config.num_moe_experts:
            router, gate_up, down = stacked_experts(state, hf + "mlp.", config.num_moe_experts)
            out.update({mc + "mlp.router": router, mc + "mlp.gate_up": gate_up, mc + "mlp.down": down})
        else:
            out[mc + "mlp.linear_fc1.weight"] = torch.cat([state[hf + "mlp.gate_proj.weight"],
                                                          state[hf + "mlp.up_proj.weight"]])
            out[mc + "mlp.linear_fc2.weight"] = state[hf + "mlp.down_proj.weight"]
    return out


def load_hf_checkpoint(model: GPTModel, model_dir: str | Path) -> GPTModel:
    """Load the checkpoint the engine serves (its ``*.safetensors``) into ``model`` (strict: every weight of the
    model is set, every tensor of the checkpoint used), in the model's dtype. Returns ``model``."""
    state = hf_state_dict(model_dir)
    try:
        mapped = hf_to_megatron_core(state, model.config)
    except KeyError as missing:
        raise ValueError(f"{model_dir}: the checkpoint has no {missing.args[0]}, which the model needs") from None
    expected = {name for name in model.state_dict() if not name.endswith("_extra_state")}
    if set(mapped) != expected:
        raise ValueError(f"{model_dir}: the checkpoint does not fit the model: missing "
                         f"{sorted(expected - set(mapped))}, unexpected {sorted(set(mapped) - expected)}")
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name in mapped:
                param.copy_(mapped[name])
    return model
