"""Vision-language checkpoints: which ones run, and how their ``config.json`` splits in two.

A vision-language model here is the text decoder the engine already runs (Llama/Mistral for LLaVA,
Qwen2 for Qwen2-VL and Qwen2.5-VL) plus a vision side whose output replaces the image placeholder
tokens' embeddings. The text part becomes an ordinary :class:`~megatron_serve.model.config.ModelConfig`;
the vision part is :class:`VisionConfig`. Hugging Face's own config classes fill in the defaults that
Hub checkpoints leave out (``llava-hf`` configs name hardly any text field) and read both the current
layout (``text_config``) and the older one (text fields at the top, ``rope_scaling.type = mrope``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import UnsupportedModelError

#: architecture -> vision kind
VISION_LANGUAGE_ARCHITECTURES = {
    "LlavaForConditionalGeneration": "llava",
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
# text model_type -> the decoder architecture that runs it
_TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_vl_text": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
}


@dataclass(frozen=True)
class VisionConfig:
    """The vision side of a vision-language model.

    ``mrope_section``: the Qwen-VL multimodal rotary split of ``head_dim // 2`` into temporal, height
    and width frequencies (None: plain 1-D rotary positions, as LLaVA). ``hf_config``: the whole
    ``transformers`` config, from which the vision modules are built.
    """

    kind: str
    image_token_id: int
    mrope_section: tuple[int, ...] | None = None
    spatial_merge_size: int = 1
    hf_config: Any = field(default=None, compare=False, repr=False)


def is_vision_language(raw: dict[str, Any]) -> bool:
    architectures = raw.get("architectures") or []
    return len(architectures) == 1 and architectures[0] in VISION_LANGUAGE_ARCHITECTURES


def split_vision_language(raw: dict[str, Any]) -> tuple[dict[str, Any], VisionConfig]:
    """``(text config as a decoder config.json, vision config)`` of a vision-language ``config.json``."""
    from transformers import AutoConfig  # noqa: PLC0415 - only vision-language models need it

    kind = VISION_LANGUAGE_ARCHITECTURES[raw["architectures"][0]]
    try:
        hf_config = AutoConfig.for_model(**raw)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad config
        raise UnsupportedModelError(f"cannot read the {raw['architectures'][0]} config: {exc}") from exc
    text = hf_config.get_text_config().to_dict()
    text_type = text.get("model_type")
    if text_type not in _TEXT_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported language model {text_type!r} in {raw['architectures'][0]}: "
                                    f"expected one of {', '.join(sorted(_TEXT_ARCHITECTURES))}")
    text["architectures"] = [_TEXT_ARCHITECTURES[text_type]]
    if text.get("tie_word_embeddings") is None:
        text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    text["torch_dtype"] = raw.get("torch_dtype") or raw.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    mrope_section = _strip_mrope(text)
    if (mrope_section is None) != (kind == "llava"):
        raise UnsupportedModelError(f"{raw['architectures'][0]}: multimodal rotary sections "
                                    f"{'missing' if mrope_section is None else 'unexpected'} in its rope settings")
    image_token_id = raw.get("image_token_id", raw.get("image_token_index"))
    if image_token_id is None:
        image_token_id = getattr(hf_config, "image_token_id", None)
    if image_token_id is None:
        raise UnsupportedModelError(f"{raw['architectures'][0]}: config.json names no image_token_id")
    merge = int(getattr(hf_config.vision_config, "spatial_merge_size", 1) or 1)
    return text, VisionConfig(kind, int(image_token_id), mrope_section, merge, hf_config)


def _strip_mrope(text: dict[str, Any]) -> tuple[int, ...] | None:
    """Take the multimodal rotary sections out of the rope settings; what is left is plain rotary."""
    section = None
    for key in ("rope_parameters", "rope_scaling"):
        params = text.get(key)
        if not isinstance(params, dict):
            continue
        params = dict(params)
        if "mrope_section" in params:
            section = tuple(int(x) for x in params.pop("mrope_section"))
        for name in ("type", "rope_type"):
            if params.get(name) == "mrope":
                params[name] = "default"
        text[key] = params
    return section
