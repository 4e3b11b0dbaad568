"""Image chats: megatron-serve (continuous batching, batched vision encoder) vs transformers generate.

Same random vision-language weights (``make-tiny-model --arch llava|qwen2_vl|qwen2_5_vl`` at the
chosen text size), the same chats: each a rendered chat template with one or two PNG images of
mixed sizes and a question, greedy, EOS ignored, every request arriving at time 0. Both sides
start from the PNG files, so image decoding and preprocessing count on both. megatron-serve runs
all requests through one engine; transformers runs static batches (its processor pads the text).
TTFT is the time from the start to a request's first token (transformers: its batch's first step).

    python benchmarks/vlm.py [--arch llava] [--requests 32] [--hidden-size 256 --layers 4] [--hf-batch-size 8]
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import tempfile
import time

import numpy as np
import torch
import transformers
from PIL import Image

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.client.prompts import ImagePrompt, tokenize_prompt
from megatron_serve.model.tiny import make_tiny_model

from cli_options import add_number_options

PLACEHOLDER = {"llava": "<image>", "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
               "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>"}
SIZES = [(56, 56), (84, 112), (140, 70), (112, 112), (224, 168)]


def png(height: int, width: int, rng: np.random.Generator) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def workload(arch: str, count: int, seed: int) -> list[tuple[str, list[bytes]]]:
    """Chats as the server renders them: the chat template with one or two images, then a question."""
    rng, images = random.Random(seed), np.random.default_rng(seed)
    chats = []
    for _ in range(count):
        files = [png(*rng.choice(SIZES), images) for _ in range(rng.choice((1, 1, 2)))]
        question = " ".join(rng.choice(["what", "is", "in", "this", "picture", "left", "colour", "shape", "and"])
                            for _ in range(rng.randint(4, 24)))
        text = (f"<|begin_of_text|><|im_start|>user\n{PLACEHOLDER[arch] * len(files)}\n{question}<|im_end|>\n"
                "<|im_start|>assistant\n")
        chats.append((text, files))
    return chats


def run_megatron(model_dir: str, warmup, chats, new_tokens: int, max_requests: int) -> tuple[float, list[float]]:
    llm = MegatronLLM(model_dir, InferenceConfig(max_requests=max_requests, max_batch_tokens=2048))
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=new_tokens, ignore_eos=True)
    # An untimed pass over other chats of the same shapes first (other content: no prefix-cache hits):
    # on a GPU it compiles the Triton kernels for the shapes the workload meets, once per process.
    for timed, chats in ((False, warmup), (True, chats)):
        started, arrival = time.perf_counter(), time.time()  # every chat arrives now: tokenizing counts too
        requests = []
        for index, (text, files) in enumerate(chats):
            tokens, images, _ = tokenize_prompt(ImagePrompt(text, files), llm.tokenizer)
            requests.append(DynamicInferenceRequest(f"{timed}-{index}", text, tokens, params, images=images))
        for request in requests:
            request.arrival_time = arrival
            llm.engine.add_request(request)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        elapsed = time.perf_counter() - started
    assert all(len(r.generated_tokens) == new_tokens for r in requests), [r.error for r in requests if r.error]
    return elapsed, [r.ttft for r in requests]


class _FirstStep(transformers.LogitsProcessor):
    """Records when generate reaches its first token (the batch's prefill is done)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.at = time.perf_counter()
        return scores


def hf_inputs(arch: str, model_dir: str, batch) -> dict[str, torch.Tensor]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    pictures = [[Image.open(io.BytesIO(f)).convert("RGB") for f in files] for _, files in batch]
    if arch == "llava":
        processor = transformers.AutoProcessor.from_pretrained(model_dir)
        processor.tokenizer.padding_side = "left"
        return dict(processor(text=[t for t, _ in batch], images=pictures, padding=True, return_tensors="pt"))
    # Qwen-VL: transformers builds the processor object only with torchvision; its image processor and its
    # expansion rule (<|image_pad|> times grid / merge^2) are what the processor does.
    image_processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
    inputs = dict(image_processor(images=[p for group in pictures for p in group], return_tensors="pt"))
    counts = iter((inputs["image_grid_thw"].prod(-1) // 4).tolist())
    texts = []
    for text, files in batch:
        pieces = text.split("<|image_pad|>")
        texts.append(pieces[0] + "".join("<|image_pad|>" * next(counts) + piece for piece in pieces[1:]))
    encoded = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    inputs.update(encoded)
    inputs["mm_token_type_ids"] = (encoded["input_ids"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")).int()
    return inputs


def run_transformers(arch: str, model_dir: str, chats, new_tokens: int, batch_size: int, device: str
                     ) -> tuple[float, list[float]]:
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir).to(device).eval()
    with torch.inference_mode():  # warm-up, as on our side
        model.generate(**{k: v.to(device) for k, v in hf_inputs(arch, model_dir, chats[:batch_size]).items()},
                       max_new_tokens=2, do_sample=False, pad_token_id=0)
    ttfts: list[float] = []
    started = time.perf_counter()
    for start in range(0, len(chats), batch_size):
        batch = chats[start:start + batch_size]
        inputs = {k: v.to(device) for k, v in hf_inputs(arch, model_dir, batch).items()}
        first = _FirstStep()
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0, logits_processor=transformers.LogitsProcessorList([first]))
        ttfts.extend([first.at - started] * len(batch))
    return time.perf_counter() - started, ttfts


def summary(name: str, seconds: float, ttfts: list[float], count: int) -> str:
    ttfts = sorted(ttfts)
    p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
    return (f"{name:<42}{seconds:>9.2f}{count / seconds:>11.2f}{statistics.mean(ttfts):>11.3f}"
            f"{statistics.median(ttfts):>11.3f}{p90:>11.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(PLACEHOLDER), default="llava")
    add_number_options(parser, hidden_size=256, layers=4, requests=32, new_tokens=32, hf_batch_size=8, max_requests=64)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(tmp, seed=0, arch=args.arch, hidden_size=args.hidden_size,
                                        num_layers=args.layers, num_heads=8, num_kv_heads=4,
                                        intermediate_size=args.hidden_size * 8 // 3))
        chats = workload(args.arch, args.requests, seed=0)
        warmup = workload(args.arch, args.requests, seed=1)
        ours, our_ttft = run_megatron(model_dir, warmup, chats, args.new_tokens, args.max_requests)
        theirs, their_ttft = run_transformers(args.arch, model_dir, chats, args.new_tokens, args.hf_batch_size, device)
    images = sum(len(files) for _, files in chats)
    print(f"{args.arch}: hidden {args.hidden_size} x {args.layers} layers, {args.requests} chats with {images} images, "
          f"{args.new_tokens} tokens each, device {device}, torch threads {torch.get_num_threads()}")
    print(f"{'engine':<42}{'seconds':>9}{'req/s':>11}{'TTFT mean':>11}{'TTFT p50':>11}{'TTFT p90':>11}")
    print(summary("megatron-serve (continuous batching)", ours, our_ttft, args.requests))
    print(summary(f"transformers generate (batch {args.hf_batch_size})", theirs, their_ttft, args.requests))
    print(f"ratio: {theirs / ours:.2f}x requests/s, {statistics.mean(their_ttft) / statistics.mean(our_ttft):.2f}x "
          "mean TTFT")


if __name__ == "__main__":
    main()
