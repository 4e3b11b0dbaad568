"""Vision-language models: greedy tokens equal ``transformers`` generate on the same random weights.

Prompts carry 0, 1 and 2 images of different sizes and run batched; variants squeeze the engine so
that chunked prefill splits an image's tokens over steps and a small KV pool forces preemption
(recomputation re-encodes the images). The reference builds its inputs with the model's processor
(LLaVA) or, for Qwen-VL whose processor object transformers builds only with torchvision, with the
processor's own expansion rule (``<|image_pad|>`` times grid / merge^2), its image processor and the
``mm_token_type_ids`` it returns.
"""

from __future__ import annotations

import io

import pytest
import torch
import transformers
from PIL import Image

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.wire.request import EventType
from megatron_serve.model.tiny import make_tiny_model

from ..images import png

NEW_TOKENS = 12
SIZES = [(84, 112), (56, 56), (140, 70)]  # (height, width): Qwen-VL makes 12, 4 and 10 tokens of them


def conversations(placeholder: str) -> list[tuple[str, list[bytes]]]:
    """Chat-rendered prompts with 0, 1 and 2 images (different sizes), as the chat template writes them."""
    one, two, three = (png(h, w, seed) for seed, (h, w) in enumerate(SIZES))
    return [
        ("<|begin_of_text|><|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n", []),
        (f"<|begin_of_text|><|im_start|>user\n{placeholder}\nWhat is this?<|im_end|>\n<|im_start|>assistant\n",
         [one]),
        (f"<|begin_of_text|><|im_start|>user\nCompare {placeholder} and {placeholder} please<|im_end|>\n"
         "<|im_start|>assistant\n", [two, three]),
        (f"<|begin_of_text|><|im_start|>user\n{placeholder}The quick brown fox<|im_end|>\n<|im_start|>assistant\n",
         [three]),
    ]


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "qwen2_5_vl"])
def vision_case(request, tmp_path_factory):
    """``(model dir, prompts, transformers' (prompt length, tokens) per prompt)`` of one architecture."""
    arch = request.param
    model_dir = str(make_tiny_model(tmp_path_factory.mktemp(arch), seed=3, arch=arch))
    prompts = conversations("<image>" if arch == "llava" else "<|vision_start|><|image_pad|><|vision_end|>")
    return model_dir, prompts, hf_greedy(arch, model_dir, prompts)


def reference_inputs(arch: str, model_dir: str, text: str, images: list[bytes]) -> dict[str, torch.Tensor]:
    pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    if arch == "llava":
        processor = transformers.AutoProcessor.from_pretrained(model_dir)
        return dict(processor(text=[text], images=pil or None, return_tensors="pt"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    inputs: dict[str, torch.Tensor] = {}
    if pil:
        image_processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
        inputs = dict(image_processor(images=pil, return_tensors="pt"))
        pieces = text.split("<|image_pad|>")
        counts = (inputs["image_grid_thw"].prod(-1) // 4).tolist()
        text = pieces[0] + "".join("<|image_pad|>" * count + piece for count, piece in zip(counts, pieces[1:]))
    inputs["input_ids"] = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    # what the processor returns beside the ids; without it transformers falls back to 1-D positions
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")).int()
    return inputs


def hf_greedy(arch: str, model_dir: str, prompts: list[tuple[str, list[bytes]]]) -> list[tuple[int, list[int]]]:
    """``(prompt length, generated tokens)`` per prompt, one prompt at a time."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for text, images in prompts:
        inputs = reference_inputs(arch, model_dir, text, images)
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
        length = inputs["input_ids"].shape[1]
        results.append((length, out[0, length:].tolist()))
    return results


@pytest.mark.parametrize("squeeze", ["roomy", "chunked-and-preempted"])
def test_greedy_matches_transformers(vision_case, squeeze):
    model_dir, prompts, expected = vision_case
    config = dict(dtype="float32", block_size_tokens=16)
    if squeeze != "roomy":  # 7-token chunks split every image; a pool for the longest request alone, plus one block
        longest = max(length for length, _ in expected) + NEW_TOKENS
        config.update(block_size_tokens=4, max_batch_tokens=7, num_kv_blocks=-(-longest // 4) + 1)
    llm = MegatronLLM(model_dir, InferenceConfig(**config))
    outs = llm.generate([{"prompt": text, "images": images} for text, images in prompts],
                        SamplingParams(temperature=0.0, num_tokens_to_generate=NEW_TOKENS, ignore_eos=True))
    for out, (length, tokens) in zip(outs, expected):
        assert out.status.value == "COMPLETED", out.error
        assert len(out.prompt_tokens) == length
        assert out.generated_tokens == tokens
    if squeeze != "roomy":
        assert any(e.type is EventType.PREEMPT for out in outs for e in out.events), "the pool must force preemption"
    assert llm.engine.worker.encoder_cache.images_encoded >= 4
