"""Small random vision-language models (LLaVA, Qwen2-VL, Qwen2.5-VL) with a working processor, made offline.

The directory looks like one from the Hub: ``config.json``, ``model.safetensors``, tokenizer files
with the model's image tokens, and the processor (``processor_config.json``: image processor,
placeholder token, chat template) that ``transformers.AutoProcessor`` loads. The image processors
are the PIL ones, so the directory loads where torchvision is not installed.

Sizes keep images cheap on a CPU: LLaVA sees a 32x32 crop as 16 tokens (4x4 patches of 8 pixels,
CLS dropped); Qwen-VL resizes each image to at most 16 merged tokens, so images of different sizes
get different token counts (56x56 -> 4, 112x84 -> 12).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}IMAGE{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
)
_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n" + _CONTENT +
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_LLAVA_IMAGE = "<image>"
_QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def make_tiny_vision_model(path: Path, arch: str, seed: int, hidden_size: int, num_layers: int, num_heads: int,
                           num_kv_heads: int, intermediate_size: int, tokenizer) -> Path:
    """Write a random ``arch`` model with processor to ``path``; ``tokenizer``: the text tokenizer to extend."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    text = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=1024)
    if arch == "llava":
        tokenizer.add_special_tokens({"additional_special_tokens": [_LLAVA_IMAGE]})
        tokenizer.chat_template = _TEMPLATE.replace("IMAGE", _LLAVA_IMAGE + "\n")
        config = transformers.LlavaConfig(
            text_config=dict(model_type="llama", vocab_size=len(tokenizer), **text, **_ids(tokenizer)),
            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8),
            image_token_id=tokenizer.convert_tokens_to_ids(_LLAVA_IMAGE), vision_feature_layer=-2,
            vision_feature_select_strategy="default", **_ids(tokenizer))
        processor = _llava_processor(tokenizer)
    else:
        tokenizer.add_special_tokens({"additional_special_tokens": _QWEN_TOKENS})
        tokenizer.chat_template = _TEMPLATE.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>")
        head_dim = hidden_size // num_heads
        section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]  # Qwen's 16/24/24 of 64, scaled
        vision: dict[str, Any] = dict(depth=2, hidden_size=hidden_size, num_heads=4, patch_size=14,
                                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        if arch == "qwen2_vl":
            vision.update(embed_dim=32, mlp_ratio=2)
        else:
            vision.update(intermediate_size=64, out_hidden_size=hidden_size, window_size=56,
                          fullatt_block_indexes=[1])
            vision["hidden_size"] = 32
        config_class = transformers.Qwen2VLConfig if arch == "qwen2_vl" else transformers.Qwen2_5_VLConfig
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), _QWEN_TOKENS)}
        config = config_class(
            text_config=dict(vocab_size=len(tokenizer), rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}, **text, **_ids(tokenizer)),
            vision_config=vision, **ids, **_ids(tokenizer))
        processor = _qwen_processor(arch)
    torch.manual_seed(seed)
    model_class = {"llava": transformers.LlavaForConditionalGeneration,
                   "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
                   "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration}[arch]
    model = model_class(config).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    return path


def _ids(tokenizer) -> dict[str, int]:
    return dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def _llava_processor(tokenizer):
    from transformers import LlavaProcessor  # noqa: PLC0415
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: PLC0415

    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, num_additional_image_tokens=1,
                          vision_feature_select_strategy="default", image_token=_LLAVA_IMAGE,
                          chat_template=tokenizer.chat_template)


def _qwen_processor(arch: str):
    """The image processor, saved in the Hub's layout (``preprocessor_config.json`` naming the processor class).

    transformers cannot build a Qwen-VL processor object without torchvision (its video processor
    needs it), so the image processor is saved alone, as Hub checkpoints have it; the tokenizer files
    and the chat template are the rest of the processor.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: PLC0415

    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 16, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)
    images.processor_class = "Qwen2VLProcessor" if arch == "qwen2_vl" else "Qwen2_5_VLProcessor"
    return images
