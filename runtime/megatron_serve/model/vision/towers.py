"""Vision towers of the supported vision-language models, and the model that joins them to the decoder.

The towers are the ``transformers`` modules themselves (CLIP/SigLIP under LLaVA's projector, the
Qwen2-VL and Qwen2.5-VL vision transformers): they run once per image, outside the paged-KV hot
path, so the library's implementation is the exact reference and there is nothing of ours to add.
What is ours is the joint: :class:`VisionLanguageModel` is the Llama-family decoder whose input
embeddings at image placeholder tokens are replaced by the tower's output, with Qwen-VL's
multimodal rotary positions (:mod:`.mrope`) where a prefill chunk holds image tokens.

Under tensor parallelism the tower lives on rank 0 only (``tp.rank == 0``): it encodes the step's
images and the embeddings are broadcast with the step, so the other ranks neither hold nor load it.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ..attention import ForwardContext
from ..config import ModelConfig
from ..llama import LlamaForCausalLM
from .mrope import mrope_cos_sin
from ..parallel import SINGLE, TensorParallel

PixelInputs = dict[str, torch.Tensor]


class LlavaTower(nn.Module):
    """LLaVA: the vision tower's hidden states of ``vision_feature_layer`` (CLS dropped under the
    ``default`` strategy), through the two-layer projector; one ``[patches, hidden]`` per image."""

    def __init__(self, hf_config: Any):
        super().__init__()
        from transformers import AutoModel  # noqa: PLC0415 - heavy import, only for vision-language models
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector  # noqa: PLC0415

        self.vision_tower = AutoModel.from_config(hf_config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config)
        self.feature_layer = hf_config.vision_feature_layer
        self.strategy = hf_config.vision_feature_select_strategy
        # transformers < 5 wraps CLIP's modules in ``vision_model``; checkpoints may name them either way
        self.tower_prefix = "vision_model." if hasattr(self.vision_tower, "vision_model") else ""

    def forward(self, inputs: PixelInputs) -> list[torch.Tensor]:
        pixel_values = inputs["pixel_values"].to(self.multi_modal_projector.linear_1.weight.dtype)
        hidden_states = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True).hidden_states
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        selected = [hidden_states[layer] for layer in layers]
        if self.strategy == "default":
            selected = [h[:, 1:] for h in selected]
        return list(self.multi_modal_projector(torch.cat(selected, dim=-1)))

    def checkpoint_name(self, name: str) -> str:
        """``vision_tower.[vision_model.]X`` / ``multi_modal_projector.X`` (prefix already cut) -> this module."""
        if name.startswith("vision_tower."):
            rest = name.removeprefix("vision_tower.").removeprefix("vision_model.")
            return f"vision_tower.{self.tower_prefix}{rest}"
        return name


class QwenVisionTower(nn.Module):
    """Qwen2-VL / Qwen2.5-VL: one vision transformer over every image's patches (``image_grid_thw``
    says where each image starts), merged 2x2 into the language model's width."""

    def __init__(self, hf_config: Any, kind: str):
        super().__init__()
        if kind == "qwen2_vl":
            from transformers.models.qwen2_vl.modeling_qwen2_vl import (  # noqa: PLC0415
                Qwen2VisionTransformerPretrainedModel as Tower,
            )
        else:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (  # noqa: PLC0415
                Qwen2_5_VisionTransformerPretrainedModel as Tower,
            )
        self.visual = Tower._from_config(hf_config.vision_config)
        self.merge = int(hf_config.vision_config.spatial_merge_size)

    def forward(self, inputs: PixelInputs) -> list[torch.Tensor]:
        grid = inputs["image_grid_thw"]
        dtype = next(self.visual.parameters()).dtype
        out = self.visual(inputs["pixel_values"].to(dtype), grid_thw=grid)
        merged = out if isinstance(out, torch.Tensor) else out.pooler_output  # transformers 4.x returns the tensor
        return list(merged.split((grid.prod(-1) // self.merge**2).tolist()))

    def checkpoint_name(self, name: str) -> str:
        return name


def build_tower(config: ModelConfig) -> LlavaTower | QwenVisionTower:
    vision = config.vision
    if vision.kind == "llava":
        return LlavaTower(vision.hf_config)
    return QwenVisionTower(vision.hf_config, vision.kind)


# checkpoint name prefix -> ours (the current transformers layout and the older Hub layout both occur)
_LANGUAGE_PREFIXES = [
    (re.compile(r"^(language_model\.model\.|model\.language_model\.)"), "model."),
    (re.compile(r"^(language_model\.lm_head\.)"), "lm_head."),
]
_VISION_PREFIX = re.compile(r"^(model\.)?(?=vision_tower\.|multi_modal_projector\.|visual\.)")


class VisionLanguageModel(LlamaForCausalLM):
    """The decoder plus a vision tower; ``encode_images`` runs the tower, ``forward`` takes the step's
    image embeddings (and multimodal positions) from ``context.multimodal``."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE, device: torch.device | str = "cpu"):
        super().__init__(config, tp, device)
        self.vision = build_tower(config) if tp.rank == 0 else None
        if self.vision is not None:
            # transformers builds the tower in the checkpoint's dtype; parameters follow ours (buffers such
            # as rotary frequencies stay float32, as in transformers)
            dtype = torch.get_default_dtype()
            for param in self.vision.parameters():
                param.data = param.data.to(dtype)

    def checkpoint_name(self, name: str) -> str | None:
        for pattern, ours in _LANGUAGE_PREFIXES:
            if pattern.match(name):
                return pattern.sub(ours, name, count=1)
        match = _VISION_PREFIX.match(name)
        if match is None:
            return name
        if self.vision is None:
            return None  # a tensor-parallel rank other than 0: the tower is not here
        return "vision." + self.vision.checkpoint_name(name[match.end():])

    @torch.inference_mode()
    def encode_images(self, inputs: PixelInputs) -> list[torch.Tensor]:
        """One ``[tokens, hidden]`` embedding per image of the batch ``inputs`` (the processor's tensors)."""
        device = self.rotary_cos.device
        return self.vision({name: tensor.to(device) for name, tensor in inputs.items()})

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        step = context.multimodal
        if step is None:
            return super().forward(token_ids, positions, context)
        hidden = self.model.embed_tokens(token_ids)
        if step.image_rows is not None:
            hidden[step.image_rows] = step.image_embeddings.to(hidden.dtype)
        cos, sin = self.rotary_cos, self.rotary_sin
        if step.mrope_positions is not None:
            cos, sin = mrope_cos_sin(cos, sin, step.mrope_positions, self.config.vision.mrope_section)
            positions = torch.arange(token_ids.shape[0], device=token_ids.device)
        return self.model(token_ids, positions, context, cos, sin, input_embeds=hidden)
