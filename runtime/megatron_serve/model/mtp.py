"""Multi-token-prediction (MTP) layers as DeepSeek-V3, GLM-4.5 and MiMo-style checkpoints store them.

``num_nextn_predict_layers`` MTP layers follow the decoder's ``num_hidden_layers`` in the checkpoint, each
named as one more decoder layer, ``model.layers.{num_hidden_layers + i}.``, holding a full decoder layer
(``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``, ``mlp.*``) plus

- ``enorm`` / ``hnorm``: RMS norms of the next token's embedding and of the previous hidden state,
- ``eh_proj``: ``[hidden, 2 * hidden]``, the projection of their concatenation ``cat(enorm(e), hnorm(h))``,
- ``shared_head.norm``: the final norm before the LM head.

One step: ``h' = layer(eh_proj(cat(enorm(embed(token)), hnorm(h))))`` and ``logits = head(shared_head.norm(h'))``,
``h`` being the target's last hidden state before its final norm. The layer's ``embed_tokens`` and
``shared_head.head`` are copies of the target's embedding and LM head (DeepSeek-V3 stores them for each MTP
layer, as vLLM's and SGLang's loaders read them); the target's own are used, so they are not loaded twice.
Only the first MTP layer is served (as in vLLM's and SGLang's default ``num_speculative_tokens`` chaining:
it is applied K times).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .errors import UnsupportedModelError
from .attention import ForwardContext
from .layers import rotary_cos_sin
from .llama import LlamaDecoderLayer, layer_ops
from .parallel import SINGLE

SHARED_WITH_TARGET = ("embed_tokens.weight", "shared_head.head.weight")


class MtpLayer(LlamaDecoderLayer):
    """One MTP layer: a decoder layer, with the norms and projection in front of it and the norm behind it."""

    def __init__(self, config: ModelConfig, layer_index: int, device: torch.device):
        ops = layer_ops(config, device)
        super().__init__(config, layer_index, ops, SINGLE, device)
        hidden = config.hidden_size
        self.enorm = ops.norm(hidden, config.rms_norm_eps)
        self.hnorm = ops.norm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = ops.norm(hidden, config.rms_norm_eps)

    def predict(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, context: ForwardContext,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed for the LM head, pre-norm hidden for the next step)`` of every row."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x, residual = self(positions, x, None, context, cos, sin)
        return self.shared_head.norm(x, residual)


class MtpLayers(nn.Module):
    """The first MTP layer under its checkpoint name, so :func:`.loader.load_weights` fills it by name (fused
    projections included) and names any tensor it lacks."""

    def __init__(self, config: ModelConfig, device: torch.device):
        super().__init__()
        if config.num_nextn_predict_layers < 1:
            raise UnsupportedModelError(f"{config.architecture} checkpoint has no MTP layers "
                                        "(config.json num_nextn_predict_layers is missing or 0): method mtp needs them")
        if config.quantization is not None:
            raise UnsupportedModelError("method mtp supports unquantized checkpoints only")
        self.config = config
        self.index = config.num_layers
        self.prefix = f"model.layers.{self.index}."
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(self.index): MtpLayer(config, self.index, device)})
        # its own tables: the target's become full-width ones under ``--batch-invariant``, which this layer is not
        cos, sin = rotary_cos_sin(config.head_dim, config.max_position_embeddings, config.rope)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)

    @property
    def layer(self) -> MtpLayer:
        return self.model.layers[str(self.index)]

    @property
    def dtype(self) -> torch.dtype:
        return self.layer.eh_proj.weight.dtype

    @property
    def num_local_kv_heads(self) -> int:
        return self.layer.self_attn.kv_size // self.config.head_dim

    def owns(self, name: str) -> bool:
        """A checkpoint tensor of the served MTP layer (copies of the target's embedding and head included)."""
        return name.startswith(self.prefix)

    def checkpoint_name(self, name: str) -> str | None:
        if not self.owns(name) or name.endswith(SHARED_WITH_TARGET):
            return None
        return name
