"""One seed, one case: the engine's settings and the requests, with the step at which each arrives.

Everything is drawn from ``random.Random`` seeded by the case seed, so a seed is a complete
reproduction. Prompt lengths cluster around multiples of the KV block and of the prefill chunk (one
token either side), where off-by-one offsets live; decode lengths cross a block boundary half the
time. Requests arrive at different steps (prefill chunks then share steps with decodes), some share
a prefix with an earlier one or repeat it whole (prefix-cache hits, and waits for blocks another
request is still computing), and the KV pool is sometimes just large enough for the largest request
alone, which forces preemption and recomputation when several run at once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from megatron_serve import SamplingParams
from megatron_serve.model.tiny import SPECIAL_TOKENS

from ..images import png
from .models import MAX_POSITIONS, LoadedModel, ModelSpec

TEXT_TOKENS = range(len(SPECIAL_TOKENS), 512)  # the tiny tokenizer's ordinary tokens (no special ones)
BLOCK_SIZES = (4, 6, 8, 16, 32)
CHUNK_SIZES = (8, 12, 16, 24, 40, 2048)
MAX_PROMPT = 96
TENSOR_PARALLEL_EVERY = 100  # one case in this many runs at a multi-rank layout (real processes over gloo: layouts())


class Sampling(Enum):
    """What a drawn request may sample with."""

    GREEDY = "greedy"  # comparable with transformers' argmax
    SEEDED = "seeded"  # greedy or seeded sampling: the same tokens whatever the batch and the settings
    ANY = "any"  # also unseeded sampling (other traffic, never compared)


@dataclass(frozen=True)
class RequestDraw:
    """One request: ``prompt`` holds one placeholder token per image (the engine expands it)."""

    name: str
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival: int = 0  # the engine step before which it is added
    images: tuple[bytes, ...] = ()
    image_sizes: tuple[tuple[int, int], ...] = ()
    shares: str = ""  # what its prompt shares with an earlier request (for the reproduction line)

    def describe(self) -> str:
        parts = [f"len={len(self.prompt)}"]
        if self.arrival:
            parts.append(f"at step {self.arrival}")
        if self.shares:
            parts.append(self.shares)
        if self.image_sizes:
            parts.append("images=" + "+".join(f"{h}x{w}" for h, w in self.image_sizes))
        parts.extend(f"{k}={v}" for k, v in self.params.to_dict().items()
                     if v != getattr(_DEFAULTS, k) and k not in ("return_log_probs", "top_n_logprobs"))
        return f"{self.name}({', '.join(parts)})"


_DEFAULTS = SamplingParams()


@dataclass(frozen=True)
class Case:
    seed: int
    config: dict[str, Any]  # InferenceConfig fields (dtype and device come from the run's options)
    kv_pool: str  # "roomy" or "tiny": turned into num_kv_blocks once prompts are expanded
    requests: tuple[RequestDraw, ...]
    fillers: tuple[RequestDraw, ...] = ()  # other traffic, for settings that run the case in a busy engine
    alternative: dict[str, Any] = field(default_factory=dict)  # second values of fields a setting varies

    def describe(self) -> str:
        return f"config {self.config} kv_pool={self.kv_pool}; " + " ".join(r.describe() for r in self.requests)


@dataclass(frozen=True)
class Vocabulary:
    """What prompts are made of: ordinary tokens, the image placeholder, and the tokens that end a request."""

    eos_ids: tuple[int, ...]
    image_token: int | None = None
    image_wrap: tuple[int, int] | None = None  # Qwen-VL's vision start / end tokens around the placeholder
    llava: bool = False

    @classmethod
    def of(cls, model: LoadedModel) -> "Vocabulary":
        tokenizer = model.tokenizer
        eos = model.eos_ids
        if tokenizer.images is None:
            return cls(eos)
        if model.spec.arch == "llava":
            return cls(eos, tokenizer.images.placeholder_id, llava=True)
        start, end = tokenizer.hf_tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
        return cls(eos, tokenizer.images.placeholder_id, (int(start), int(end)))


def _length(rng: random.Random, block: int, chunk: int, limit: int) -> int:
    """A prompt length near a multiple of the block or of the chunk, sometimes anywhere."""
    if rng.random() < 0.25:
        length = rng.randint(1, 40)
    else:
        unit = rng.choice([block, min(chunk, MAX_PROMPT)])
        length = unit * rng.randint(1, max(1, MAX_PROMPT // unit // 2)) + rng.choice([-1, 0, 1])
    return max(1, min(length, limit))


def _new_tokens(rng: random.Random, prompt_length: int, block: int) -> int:
    """Decode lengths that end next to a block boundary (one token either side) half the time."""
    if rng.random() < 0.5:
        return max(1, block - prompt_length % block + rng.choice([-1, 0, 1, block]))
    return rng.randint(1, 20)


def _controls(rng: random.Random, vocab: Vocabulary) -> dict[str, Any]:
    """Logit bias and penalties for some requests: they change the logits of every step."""
    if rng.random() >= 0.3:
        return {}
    return dict(logit_bias={rng.choice(vocab.eos_ids): rng.choice([-3.0, 2.0]),
                            rng.choice(TEXT_TOKENS): rng.uniform(0.5, 4.0)},
                repetition_penalty=rng.choice([1.0, 0.8, 1.3]), presence_penalty=rng.choice([0.0, 0.5, -0.5]),
                frequency_penalty=rng.choice([0.0, 0.3, -0.3]))


def _params(rng: random.Random, vocab: Vocabulary, new_tokens: int, moe: bool, sampling: Sampling) -> SamplingParams:
    fields: dict[str, Any] = dict(num_tokens_to_generate=new_tokens, return_log_probs=True, top_n_logprobs=2,
                                  temperature=0.0)
    if sampling is not Sampling.GREEDY and rng.random() < 0.5:
        fields.update(temperature=rng.choice([0.5, 0.8, 1.0, 1.5]), top_p=rng.choice([1.0, 0.9, 0.5]),
                      top_k=rng.choice([0, 0, 5, 40]), min_p=rng.choice([0.0, 0.0, 0.05]))
        if sampling is Sampling.SEEDED or rng.random() < 0.5:
            fields["seed"] = rng.randrange(2**31)
    if rng.random() < 0.5:
        fields["ignore_eos"] = True  # EOS is emitted like any token and generation goes on
    elif rng.random() < 0.3:
        fields["termination_id"] = list(vocab.eos_ids)  # the same ids, named by the request
    if rng.random() < 0.2:
        fields["stop_token_ids"] = [rng.choice(TEXT_TOKENS)]
    if rng.random() < 0.25:
        fields["min_tokens"] = rng.randint(1, new_tokens)
    if rng.random() < 0.2:
        fields["return_prompt_log_probs"] = True  # such a request reads nothing from the prefix cache
    if moe and rng.random() < 0.3:
        fields["return_routing_indices"] = True  # nor does one that records its expert routing
    fields.update(_controls(rng, vocab))
    return SamplingParams(**fields)


def _prompt(rng: random.Random, length: int, vocab: Vocabulary, images: int
            ) -> tuple[list[int], list[bytes], list[tuple[int, int]]]:
    """Random ordinary tokens with ``images`` placeholders at random places (images in placeholder order)."""
    text = [rng.choice(TEXT_TOKENS) for _ in range(length)]
    cuts = sorted(rng.randint(0, length) for _ in range(images))
    tokens: list[int] = []
    files, sizes = [], []
    previous = 0
    for cut in cuts:
        tokens += text[previous:cut]
        tokens += [vocab.image_token] if vocab.image_wrap is None else [
            vocab.image_wrap[0], vocab.image_token, vocab.image_wrap[1]]
        side = (20, 32, 45, 64) if vocab.llava else (56, 70, 84, 112, 140)  # Qwen-VL: 4 to 25 merged tokens
        height, width = rng.choice(side), rng.choice(side)
        files.append(png(height, width, rng.randrange(1000)))
        sizes.append((height, width))
        previous = cut
    return tokens + text[previous:], files, sizes


def context_of(model: LoadedModel) -> int:
    """The longest sequence the engine serves for this model (a sliding window caps it)."""
    return min(MAX_POSITIONS, model.spec.shapes.get("sliding_window") or MAX_POSITIONS)


def draw_requests(rng: random.Random, model: LoadedModel, vocab: Vocabulary, block: int, chunk: int,
                  count: int, sampling: Sampling, prefix: str = "r") -> list[RequestDraw]:
    limit = min(MAX_PROMPT, context_of(model) - 2)
    moe = model.spec.expert_layers
    drawn: list[RequestDraw] = []
    for index in range(count):
        images = rng.choice([0, 1, 1, 2]) if vocab.image_token is not None else 0
        tokens, files, sizes = _prompt(rng, _length(rng, block, chunk, limit), vocab, images)
        shares = ""
        if drawn and rng.random() < 0.4:  # a prefix of an earlier request, cut near a block boundary, or all of it
            earlier = rng.choice(drawn)
            whole = rng.random() < 0.3
            cut = len(earlier.prompt) if whole else min(
                len(earlier.prompt), max(1, block * rng.randint(0, 3) + rng.choice([-1, 0, 1])))
            kept = earlier.prompt[:cut].count(vocab.image_token) if vocab.image_token is not None else 0
            own = ([], [], []) if whole else (tokens, files, sizes)
            tokens = list(earlier.prompt[:cut]) + own[0]
            files = list(earlier.images[:kept]) + own[1]
            sizes = list(earlier.image_sizes[:kept]) + own[2]
            shares = f"first {cut} of {earlier.name}"
        while len(tokens) > limit:  # drop the tail, and with it any image whose placeholder went
            tokens.pop()
            if vocab.image_token is not None and tokens.count(vocab.image_token) < len(files):
                files, sizes = files[:-1], sizes[:-1]
        params = _params(rng, vocab, _new_tokens(rng, len(tokens), block), moe, sampling)
        arrival = 0 if rng.random() < 0.6 else rng.randint(1, 8)
        drawn.append(RequestDraw(f"{prefix}{index}", tuple(tokens), params, arrival, tuple(files), tuple(sizes),
                                 shares))
    return drawn


def layouts(spec: ModelSpec) -> list[dict[str, Any]]:
    """The multi-rank layouts a model can run: TP 2; expert parallelism over 2 or 4 tensor-parallel ranks; 2 or 3
    pipeline stages (the search's models have 1 to 3 layers: 3 over 2 stages split 2+1); data-parallel attention 2,
    and 2 of 2 tensor-parallel ranks each."""
    drawn: list[dict[str, Any]] = []
    if spec.splits_over(2):
        drawn.append({"tensor_parallel_size": 2})
    drawn += [{"tensor_parallel_size": size, "enable_expert_parallel": True} for size in (2, 4)
              if spec.experts_split_over(size)]
    drawn += [{"pipeline_parallel_size": stages} for stages in (2, 3) if spec.stages_over(stages)]
    drawn += [{"data_parallel_size": 2, "tensor_parallel_size": tp, "enable_expert_parallel": True} for tp in (1, 2)
              if spec.attention_ranks_over(2, tp)]
    return drawn


def draw_layout(rng: random.Random, spec: ModelSpec) -> dict[str, Any]:
    """One of :func:`layouts` at random (none: the model runs on one rank only)."""
    drawn = layouts(spec)
    return rng.choice(drawn) if drawn else {}


def draw_case(seed: int, model: LoadedModel, sampling: Sampling = Sampling.GREEDY,
              tensor_parallel: bool = True) -> Case:
    """Case ``seed`` on ``model``. ``tensor_parallel``: whether this search runs some cases at TP=2 itself."""
    rng = random.Random(f"parity-case-{seed}")
    vocab = Vocabulary.of(model)
    block, chunk = rng.choice(BLOCK_SIZES), rng.choice(CHUNK_SIZES)
    config: dict[str, Any] = dict(
        block_size_tokens=block, max_batch_tokens=chunk, max_requests=rng.choice([1, 2, 3, 64, 64, 64]),
        enable_prefix_caching=rng.random() < 0.6, enable_cuda_graphs=rng.random() < 0.3, seed=rng.randrange(1000))
    if tensor_parallel and seed % TENSOR_PARALLEL_EVERY == TENSOR_PARALLEL_EVERY - 1:
        # drawn apart: the case's other draws stay what they are at one rank
        config.update(draw_layout(random.Random(f"parity-layout-{seed}"), model.spec))
    requests = draw_requests(rng, model, vocab, block, chunk, rng.randint(1, 3 if model.spec.vision else 4), sampling)
    fillers = draw_requests(rng, model, vocab, block, chunk, rng.randint(1, 4), Sampling.ANY, prefix="other")
    if rng.random() < 0.15 and not model.spec.vision:  # (a limit for a text prompt: images would expand past it)
        longest = max(len(r.prompt) for r in requests)
        config["max_sequence_length"] = min(context_of(model), longest + rng.randint(2, 12))
    alternative = dict(block_size_tokens=rng.choice([b for b in BLOCK_SIZES if b != block]),
                       max_batch_tokens=rng.choice([c for c in CHUNK_SIZES if c != chunk]))
    return Case(seed, config, rng.choice(["roomy", "roomy", "tiny"]), tuple(requests), tuple(fillers), alternative)
