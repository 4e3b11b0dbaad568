"""What ``transformers`` says a request should produce: one request at a time, greedy, with its own KV cache.

The loop calls the model's own forward (no ``generate``): every step's logits are the model's raw
logits, so the argmax the comparison checks is the reference's real choice, and nothing masks EOS
unless the request asks (``min_tokens``). Logit controls are applied in the engine's documented
order with ``transformers``' processors (logit bias, min_tokens, repetition penalty), and by the
OpenAI formula for the frequency and presence penalties, which ``transformers`` does not have.
Images go through the model's own processor: LLaVA's (which also says how many tokens an image
takes) and Qwen-VL's image processor (``grid / merge_size**2`` tokens, the Qwen-VL processor's rule,
since that processor object needs torchvision).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import torch
import transformers
from PIL import Image

from megatron_serve import SamplingParams

from .cases import RequestDraw
from .models import LoadedModel


@dataclass
class Reference:
    """One request's expected run: ``choices`` ends with the stop token when one ended it (as transformers' ``generate``
    and the engine's tokens do)."""

    prompt: list[int]
    choices: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # top-1 minus top-2 of the (controlled) logits
    log_probs: list[float] = field(default_factory=list)  # raw log-softmax at each choice
    stopped: bool = False  # the last choice is a stop token
    prompt_log_probs: list[float] = field(default_factory=list)


def controlled_logits(raw: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                      stop_ids: frozenset[int]) -> torch.Tensor:
    """``raw`` ``[vocab]`` after the request's logit controls, in the engine's order (vLLM's)."""
    scores = raw.float()[None].clone()
    ids = torch.tensor([prompt + output])
    if params.logit_bias:
        bias = [[[token], value] for token, value in params.logit_bias.items()]
        scores = transformers.SequenceBiasLogitsProcessor(bias)(ids, scores)
    if params.min_tokens and stop_ids:
        scores = transformers.MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, sorted(stop_ids))(
            ids, scores)
    if params.repetition_penalty != 1.0:
        scores = transformers.RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output), minlength=scores.shape[-1])[None].to(scores.dtype)
        scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(scores.dtype)
    return scores[0]


def sampling_distribution(raw: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
                          ) -> torch.Tensor:
    """The probabilities a sampled request draws its next token from: controls, then temperature, min-p,
    top-k and top-p with ``transformers``' warpers, in the engine's order."""
    scores = controlled_logits(raw, prompt, output, params, frozenset())[None]
    ids = torch.tensor([prompt + output])
    warpers: list[transformers.LogitsProcessor] = [transformers.TemperatureLogitsWarper(params.temperature)]
    if params.min_p:
        warpers.append(transformers.MinPLogitsWarper(params.min_p))
    if params.top_k:
        warpers.append(transformers.TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(transformers.TopPLogitsWarper(params.top_p))
    for warper in warpers:
        scores = warper(ids, scores)
    return scores.softmax(-1)[0]


def stop_ids(params: SamplingParams, eos_ids: tuple[int, ...]) -> frozenset[int]:
    """What ends a request: its stop_token_ids, and EOS unless it ignores EOS (its termination_id, if named)."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        named = params.termination_id
        ids |= set(eos_ids if named is None else named if isinstance(named, list) else [named])
    return frozenset(ids)


def _pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def model_inputs(model: LoadedModel, draw: RequestDraw, placeholder: int | None, device: str,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The forward inputs of the prompt, images expanded and encoded by the model's own processor."""
    tokens = list(draw.prompt)
    inputs: dict[str, torch.Tensor] = {}
    if draw.images:
        images = [_pil(data) for data in draw.images]
        if model.spec.arch == "llava":
            processor = model.processor
            inputs = dict(processor.image_processor(images=images, return_tensors="pt"))
            one = processor(text=processor.image_token, images=images[:1], return_tensors="pt")["input_ids"][0]
            counts = [int((one == placeholder).sum())] * len(images)
        else:
            inputs = dict(model.processor(images=images, return_tensors="pt"))
            counts = (inputs["image_grid_thw"].prod(-1) // model.processor.merge_size ** 2).tolist()
        expanded: list[int] = []
        remaining = iter(counts)
        for token in tokens:
            expanded += [token] * next(remaining) if token == placeholder else [token]
        tokens = expanded
        if model.spec.arch != "llava":  # what Qwen-VL's processor returns beside the ids (M-RoPE needs it)
            inputs["mm_token_type_ids"] = (torch.tensor([tokens]) == placeholder).int()
    inputs["input_ids"] = torch.tensor([tokens])
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in inputs.items()}


@torch.inference_mode()
def run_reference(model: LoadedModel, draw: RequestDraw, device: str, dtype: torch.dtype,
                  max_sequence_length: int) -> Reference:
    """Greedy decoding of one request by ``transformers``, stopping where the engine must stop."""
    hf = model.reference(device, dtype)
    inputs = model_inputs(model, draw, hf.config.image_token_id if model.spec.vision else None, device,
                          dtype)
    prompt = inputs["input_ids"][0].tolist()
    params = draw.params
    stops = stop_ids(params, model.eos_ids)
    budget = min(params.num_tokens_to_generate, max_sequence_length - len(prompt))
    inner = getattr(hf, "model", None)
    if inner is not None and hasattr(inner, "rope_deltas"):
        inner.rope_deltas = None  # Qwen-VL keeps the last prompt's M-RoPE offsets on the model
    cache = transformers.DynamicCache(config=hf.config)
    logits = hf(**inputs, past_key_values=cache, use_cache=True).logits[0].float()
    reference = Reference(prompt)
    if params.return_prompt_log_probs:
        reference.prompt_log_probs = torch.log_softmax(logits[:-1], -1).gather(
            1, torch.tensor(prompt[1:], device=device)[:, None])[:, 0].tolist()
    raw = logits[-1]
    while True:
        scores = controlled_logits(raw.cpu(), prompt, reference.choices, params, stops)
        top = torch.topk(scores, 2).values
        token = int(scores.argmax())
        reference.choices.append(token)
        reference.margins.append(float(top[0] - top[1]) if torch.isfinite(top[1]) else float("inf"))
        reference.log_probs.append(float(torch.log_softmax(raw, -1)[token]))
        if token in stops:
            reference.stopped = True
            return reference
        if len(reference.choices) >= budget:
            return reference
        step = torch.tensor([[token]], device=device)
        raw = hf(input_ids=step, past_key_values=cache, use_cache=True).logits[0, -1].float()
