"""The Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm), dense or with
mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE: see ``moe``).

Module names mirror the Hugging Face checkpoints (``model.layers.N.self_attn...``) except where
projections are fused (``qkv_proj``, ``gate_up_proj``, stacked experts); the loader maps between the two.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_kernels import get_op, invariant_probe
from megatron_kernels.invariant_attention import Workspace

from .attention import ForwardContext, PagedAttention
from .config import ModelConfig
from .errors import UnsupportedModelError
from .fp8_layers import linears_for
from .layers import (ColumnParallelLinear, GatedMLP, ParallelLMHead, ReplicatedLinear, RMSNorm, RowParallelLinear,
                     VocabParallelEmbedding, invariant_rotary_cos_sin, rotary_cos_sin)
from .linears import Linears
from .experts.moe import FusedExperts, SparseMoeBlock
from .layout import heads_problem, stage_layers
from .parallel import SINGLE, TensorParallel

if TYPE_CHECKING:  # annotations only: the engine installs the expert-parallel backend after the build
    from .experts.dispatch import ExpertStep
    from .experts.eplb import StepBalancer

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.")  # a decoder layer's checkpoint tensors


class _Ops:
    """The kernels one model instance uses, resolved once for its device, and the builder of its linear
    layers (FP8 ones where the model's quantization config puts them)."""

    def __init__(self, device: torch.device, linears: Linears):
        self.rms_norm = get_op("rms_norm", device)
        self.fused_add_rms_norm = get_op("fused_add_rms_norm", device)
        self.silu_and_mul = get_op("silu_and_mul", device)
        self.linears = linears

    def norm(self, size: int, eps: float) -> RMSNorm:
        return RMSNorm(size, eps, self.rms_norm, self.fused_add_rms_norm)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, ops: _Ops, tp: TensorParallel, device: torch.device):
        super().__init__()
        problem = heads_problem(config.num_heads, tp.size)
        if problem is not None:
            raise UnsupportedModelError(problem)
        head_dim = config.head_dim
        self.head_dim = head_dim
        name = f"model.layers.{layer_index}.self_attn"
        self.qkv_proj = ops.linears.column(
            name, ("q_proj", "k_proj", "v_proj"), config.hidden_size,
            {"q": (config.num_heads * head_dim, head_dim), "k": (config.num_kv_heads * head_dim, head_dim),
             "v": (config.num_kv_heads * head_dim, head_dim)},
            bias=config.qkv_bias,
            tp=tp,
        )
        self.q_size = self.qkv_proj.slices["q"][2]
        self.kv_size = self.qkv_proj.slices["k"][2]
        self.o_proj = ops.linears.row(f"{name}.o_proj", config.num_heads * head_dim, config.hidden_size, tp=tp)
        self.q_norm = ops.norm(head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = ops.norm(head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn = PagedAttention(layer_index, head_dim**-0.5, device)

    def project(self, positions: torch.Tensor, hidden: torch.Tensor, context: ForwardContext,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q, k, v of the normed hidden states; k and v go to the cache; returns the rotated q ``[T, heads, D]``."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.q_size // self.head_dim, self.head_dim)
        k = k.view(-1, self.kv_size // self.head_dim, self.head_dim)
        v = v.view(-1, self.kv_size // self.head_dim, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.attn.store(q, k, v, positions, cos, sin, context)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, ops: _Ops, tp: TensorParallel, device: torch.device):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index, ops, tp, device)
        self.sparse = config.moe is not None and config.moe.is_sparse(layer_index)
        layer = f"model.layers.{layer_index}"
        if self.sparse:
            self.mlp: nn.Module = SparseMoeBlock(config.hidden_size, config.moe, ops.silu_and_mul, ops.linears,
                                                 config.family, layer, tp, device)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, ops.silu_and_mul, ops.linears,
                                f"{layer}.mlp", tp)
        self.input_layernorm = ops.norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ops.norm(config.hidden_size, config.rms_norm_eps)

    def before_attention(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                         context: ForwardContext, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input norm and attention's projections up to the cache write: ``(rotated q, residual)``."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.self_attn.project(positions, hidden, context, cos, sin), residual

    def after_attention(self, attended: torch.Tensor, residual: torch.Tensor, context: ForwardContext
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projection, post-attention norm and MLP: ``(hidden, residual)`` for the next layer."""
        hidden = self.self_attn.o_proj(attended.flatten(1))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if self.sparse:
            return self.mlp(hidden, context.routing), residual
        return self.mlp(hidden), residual

    def forward(self, positions, hidden, residual, context, cos, sin):
        q, residual = self.before_attention(positions, hidden, residual, context, cos, sin)
        return self.after_attention(self.self_attn.attn.attend(q, context), residual, context)


def layer_ops(config: ModelConfig, device: torch.device) -> _Ops:
    """The kernels and linear-layer builder of a decoder layer built outside a model (an MTP layer)."""
    return _Ops(device, linears_for(config.quantization))


class PipelineGap(nn.Module):
    """A layer another pipeline stage holds: keeps the layers' indices those of the checkpoint."""


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: _Ops, tp: TensorParallel, device: torch.device):
        super().__init__()
        self.stage = tp.stage
        self.own = stage_layers(config.num_layers, tp.stage.size)[tp.stage.index]
        if tp.stage.size > 1 and (config.moe is not None or config.vision is not None):
            raise UnsupportedModelError("pipeline parallelism serves dense text models only (not "
                                        f"{config.architecture})")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, index, ops, tp, device) if index in self.own else PipelineGap()
            for index in range(config.num_layers)
        )
        self.norm = ops.norm(config.hidden_size, config.rms_norm_eps)
        # MTP speculation (engine.speculative.mtp) reads every row's last hidden state before the final norm;
        # off by default: then nothing is kept (one attribute test per forward)
        self.capture_hidden = False
        self.captured_hidden: torch.Tensor | None = None
        # EAGLE-3 (engine.speculative.eagle3) reads instead the inputs of these layers, concatenated
        self.aux_layers: tuple[int, ...] = ()

    def forward(self, token_ids, positions, context, cos, sin, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if self.stage.size > 1:
            return self.pipelined(token_ids, positions, [(slice(0, token_ids.shape[0]), context)], cos, sin)
        hidden = self.embed_tokens(token_ids) if input_embeds is None else input_embeds
        residual, aux = None, {}
        for index in self.own:
            if index in self.aux_layers:
                aux[index] = hidden if residual is None else hidden + residual
            hidden, residual = self.layers[index](positions, hidden, residual, context, cos, sin)
        hidden, summed = self.norm(hidden, residual)
        if self.capture_hidden:
            self.captured_hidden = torch.cat([aux[i] for i in self.aux_layers], dim=-1) if aux else summed
        return hidden

    def pipelined(self, token_ids: torch.Tensor, positions: torch.Tensor,
                  parts: list[tuple[slice, ForwardContext]], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """This stage's layers over each micro-batch in turn (``parts``: its rows of the step and its own context):
        stage 0 embeds a micro-batch, a later stage receives its hidden states and residual from the stage before;
        each is sent on without waiting, so a stage runs micro-batch ``m`` while the next runs ``m - 1``. The last
        stage's final hidden states of every row are broadcast to every rank, which all compute the logits."""
        stage, sent = self.stage, []
        out = self.embed_tokens.weight.new_empty((token_ids.shape[0], self.embed_tokens.weight.shape[1]))
        for tag, (rows, context) in enumerate(parts):
            if stage.index:  # the stage before computed the layers up to ours
                hidden, residual = stage.receive(out[rows], out[rows], tag=tag)
            else:
                hidden, residual = self.embed_tokens(token_ids[rows]), None
            for index in self.own:
                hidden, residual = self.layers[index](positions[rows], hidden, residual, context, cos, sin)
            if stage.is_last:
                out[rows] = self.norm(hidden, residual)[0]
            else:
                sent += stage.send(hidden, residual, tag=tag)
        for _tensor, work in sent:
            work.wait()
        return stage.share_output(out)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head. ``forward`` returns hidden states; ``compute_logits`` only for rows that sample."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE, device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.tp = tp
        ops = _Ops(device, linears_for(config.quantization))
        self.model = LlamaModel(config, ops, tp, device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rotary_cos_sin(config.head_dim, config.max_position_embeddings, config.rope, self.dtype)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)
        self._mtp_prefixes = tuple(f"model.layers.{config.num_layers + i}."
                                   for i in range(config.num_nextn_predict_layers))
        # what the MoE layers of a forward agree on with the other expert-parallel ranks: set by the engine's
        # backend (.expert_dispatch.install_dispatchers), None where no MoE layer moves tokens between ranks
        self.expert_step: ExpertStep | None = None
        # EPLB (--enable-eplb): the engine's balancer, stepped by the runner before each forward; None: off
        self.expert_balancer: StepBalancer | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype activations, norms and the KV cache are computed in (FP8 layers hold e4m3 weights)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def num_local_kv_heads(self) -> int:
        return self.model.layers[self.model.own[0]].self_attn.kv_size // self.config.head_dim

    def checkpoint_name(self, name: str) -> str | None:
        """Where checkpoint tensor ``name`` goes in this module tree (None: not held here; MTP layers, stored as
        layers past the decoder's, are the MTP proposer's; another pipeline stage's layers are its own)."""
        if self._mtp_prefixes and name.startswith(self._mtp_prefixes):
            return None
        layer = _LAYER.match(name)
        if layer is not None and int(layer[1]) < self.config.num_layers and int(layer[1]) not in self.model.own:
            return None  # another pipeline stage's layer (one past the decoder's is nobody's: refused by the loader)
        return name

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        return self.model(token_ids, positions, context, self.rotary_cos, self.rotary_sin)

    def pipelined(self, token_ids: torch.Tensor, positions: torch.Tensor,
                  parts: list[tuple[slice, ForwardContext]]) -> torch.Tensor:
        """A step's micro-batches through the pipeline stages (:meth:`LlamaModel.pipelined`)."""
        return self.model.pipelined(token_ids, positions, parts, self.rotary_cos, self.rotary_sin)

    def use_batch_invariant_ops(self) -> None:
        """Switch every op of the forward to ``--batch-invariant`` arithmetic (:mod:`megatron_kernels.invariant`),
        op for op what ``transformers``' modeling code computes under ``megatron_serve.invariant``.

        The rotary tables become full-width and in the model dtype, as ``transformers`` rotates in it. FP8
        layers run weight-only through the same GEMMs (:mod:`megatron_kernels.invariant_fp8`). On a CPU the
        BLAS's GEMMs are probed first with this model's shapes (:mod:`megatron_kernels.invariant_probe`): a
        library that computes an element differently with the rows or columns around it refuses the mode.
        """
        if self.config.vision is not None:
            raise UnsupportedModelError("--batch-invariant supports text models only, not vision-language models")
        if self.rotary_cos.device.type == "cpu":
            problems = invariant_probe.cpu_problems(self._gemm_linears(), self.config.head_dim)
            if problems:
                raise UnsupportedModelError("--batch-invariant: this CPU's GEMMs change a row's bits with the "
                                            "shapes around it, so no log prob could be promised: "
                                            + "; ".join(problems))
            for module in self.modules():  # fused q|k|v, gate|up in one GEMM where its columns are the parts'
                if isinstance(module, ColumnParallelLinear) and len(module.slices) > 1:
                    parts = tuple(length for _offset, _start, length in module.slices.values())
                    module.fused_invariant = invariant_probe.fusion_holds(self._in_compute_dtype(module.weight),
                                                                          parts)
            if self.tp.gathered_rows and (split := self.column_split_problems()):
                logger.warning("--batch-invariant with expert parallelism: each request's log probs are its own in "
                               "any batch, but not one rank's in the last bits on this CPU: %s", "; ".join(split))
        workspace = Workspace()  # the attention layers' scratch tensors, shared: they run one after another
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear, VocabParallelEmbedding,
                                   PagedAttention)):
                module.batch_invariant = True
                if isinstance(module, PagedAttention):
                    module.workspace = workspace
            elif isinstance(module, (RMSNorm, GatedMLP, FusedExperts, SparseMoeBlock)):
                module.use_invariant_ops()
        cos, sin = invariant_rotary_cos_sin(self.config.head_dim, self.config.max_position_embeddings,
                                            self.config.rope, self.dtype)
        self.rotary_cos, self.rotary_sin = cos.to(self.rotary_cos.device), sin.to(self.rotary_sin.device)

    def column_split_problems(self) -> list[str]:
        """Where this group's tensor-parallel column slices (of the column-parallel projections, the gathered
        row-parallel ones and the LM head) do not compute the columns one rank's whole GEMM does, on this CPU
        (:func:`megatron_kernels.invariant_probe.column_split_problems`; a GPU's Triton GEMM tiles its columns
        alike whatever their count): what keeps an expert-parallel group's log probs from being one rank's."""
        if self.tp.size == 1 or self.rotary_cos.device.type != "cpu":
            return []
        splits = []
        for module in self.modules():
            if isinstance(module, ColumnParallelLinear):
                for name, (_offset, _start, length) in module.slices.items():
                    whole = module.features[name]
                    splits.append(((whole, module.weight.shape[1]), self.dtype, (length,) * (whole // length)))
            elif isinstance(module, ParallelLMHead):
                rows, vocab = module.rows_per_rank, module.vocab_size
                parts = tuple(min(rows, vocab - start) for start in range(0, vocab, rows))
                splits.append(((vocab, module.weight.shape[1]), self.dtype, parts))
        return invariant_probe.column_split_problems(splits)

    def _gemm_linears(self) -> list[invariant_probe.Linear]:
        """A weight of every shape the mode's GEMMs multiply by, in the compute dtype, with its fused parts:
        an expert stack's first expert; an FP8 weight's shape in the model dtype (dequantized per call); at
        most the first 8,192 output rows of each: the LM head's whole vocabulary would cost seconds at every
        start, and 8,192 is a whole number of the library's column tiles, as the full weight's first 8,192
        columns are (a sample of the real shape, not all of it: the probe is a check, ``tests/invariance``
        the proof)."""
        linears: list[invariant_probe.Linear] = []
        for module in self.modules():
            if isinstance(module, ColumnParallelLinear):  # fused, and each part (run alone where fusing differs)
                parts = tuple(length for _offset, _start, length in module.slices.values())
                linears.append((self._in_compute_dtype(module.weight), parts))
                linears += [(self._in_compute_dtype(module.weight[offset:offset + length]), (length,))
                            for offset, _start, length in module.slices.values()]
            elif isinstance(module, (RowParallelLinear, ReplicatedLinear, ParallelLMHead)):
                weight = self._in_compute_dtype(module.weight[:8192])
                linears.append((weight, (weight.shape[0],)))
            elif isinstance(module, FusedExperts):
                for stack in (module.gate_up_proj, module.down_proj):
                    linears.append((self._in_compute_dtype(stack[0]), (stack.shape[1],)))
        return linears

    def _in_compute_dtype(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if weight.dtype == self.dtype else torch.randn(weight.shape).to(self.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
