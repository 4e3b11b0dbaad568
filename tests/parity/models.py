"""The random models of the parity search: one seed draws an architecture and its shapes, and writes it.

Architectures come round-robin from ``megatron_serve.model.tiny.ARCHITECTURE_NAMES`` (every one the
engine serves: dense Llama / Mistral / Qwen2 / Qwen3, the MoE ones, the vision-language ones), so an
architecture added there joins the search with no change here. Shapes are drawn per seed: heads,
KV heads (MHA, GQA, MQA), a ``head_dim`` that need not be ``hidden_size / heads`` nor a power of two,
tied or untied embeddings, rope scaling kinds, experts and their routing, layer counts.

Two things make the weights harder to match than ``transformers``' initialisation: every norm
weight and bias is randomised (initialised to ones and zeros, an engine that ignored them would
still pass), and a larger ``initializer_range`` spreads the logits, so fewer greedy steps fall
under the comparison's margin. One token the model likes to generate is written to
``generation_config.json`` as a second EOS id, so requests that honour EOS actually stop, and
``ignore_eos`` requests actually emit EOS and go on.
"""

from __future__ import annotations

import functools
import json
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from megatron_serve import InferenceConfig
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.model.tiny import ARCHITECTURE_NAMES, VISION_ARCHITECTURES, make_tiny_model
from megatron_serve.tokenizer import Tokenizer

from ..helpers import written_once

MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
MAX_POSITIONS = 512
LOADED_MODELS = 2  # cases come grouped by model: only the current and the previous stay loaded
CASES_PER_MODEL = 8  # consecutive case seeds share a model: written once, loaded once


@dataclass(frozen=True)
class ModelSpec:
    """What one model seed drew; ``describe()`` is its part of a case's reproduction line."""

    seed: int
    arch: str
    shapes: dict[str, Any]

    @property
    def vision(self) -> bool:
        return self.arch in VISION_ARCHITECTURES

    @property
    def expert_layers(self) -> bool:
        """Whether any layer is sparse (Qwen-MoE's ``decoder_sparse_step`` and ``mlp_only_layers`` can leave none)."""
        if self.arch not in MOE_ARCHITECTURES:
            return False
        step, dense = self.shapes.get("decoder_sparse_step", 1), self.shapes.get("mlp_only_layers", [])
        return any((i + 1) % step == 0 and i not in dense for i in range(self.shapes["num_layers"]))

    def splits_over(self, ranks: int) -> bool:
        """Whether tensor parallelism can split it: whole query heads per rank, KV heads split or replicated."""
        heads, kv_heads = self.shapes["num_heads"], self.shapes["num_kv_heads"]
        return heads % ranks == 0 and (kv_heads % ranks == 0 or ranks % kv_heads == 0)

    def experts_split_over(self, ranks: int) -> bool:
        """Whether expert parallelism over ``ranks`` tensor-parallel ranks can place its experts (whole ones each)."""
        experts = self.shapes.get("num_experts", self.shapes.get("num_local_experts", 0))
        return self.expert_layers and self.splits_over(ranks) and experts % ranks == 0

    def attention_ranks_over(self, dp: int, tp: int = 1) -> bool:
        """Whether data-parallel attention over ``dp`` ranks of ``tp`` tensor-parallel ranks can place its experts
        (whole ones on each of the ``dp x tp`` ranks)."""
        experts = self.shapes.get("num_experts", self.shapes.get("num_local_experts", 0))
        return self.expert_layers and self.splits_over(tp) and experts % (dp * tp) == 0

    def stages_over(self, stages: int) -> bool:
        """Whether pipeline stages can split it: a text model without experts (stages refuse MoE and vision ones),
        one layer at least per stage."""
        experts = self.shapes.get("num_experts", self.shapes.get("num_local_experts", 0))
        return not experts and not self.vision and self.shapes["num_layers"] >= stages

    def describe(self) -> str:
        return f"{self.arch}({', '.join(f'{k}={v}' for k, v in self.shapes.items())})"


def _rope(rng: random.Random) -> dict[str, Any]:
    theta = rng.choice([10000.0, 500000.0, 1000000.0])
    kind = rng.choice(["default", "default", "linear", "llama3"])
    if kind == "default":
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": rng.choice([2.0, 4.0, 8.0])}
    return {"rope_type": "llama3", "rope_theta": theta, "factor": rng.choice([4.0, 8.0, 32.0]),
            "low_freq_factor": rng.choice([1.0, 2.0]), "high_freq_factor": rng.choice([4.0, 8.0]),
            "original_max_position_embeddings": rng.choice([16, 64, 256])}


def _experts(arch: str, rng: random.Random, num_layers: int) -> dict[str, Any]:
    """Experts and their routing; some layers may stay dense (Qwen-MoE), never all of them."""
    experts = rng.randint(2, 8)
    top_k = rng.randint(1, min(4, experts))
    if arch == "mixtral":
        return dict(num_local_experts=experts, num_experts_per_tok=top_k)
    shapes: dict[str, Any] = dict(num_experts=experts, num_experts_per_tok=top_k,
                                  moe_intermediate_size=rng.choice([16, 24, 32]), norm_topk_prob=rng.random() < 0.5)
    if num_layers > 1 and rng.random() < 0.3:
        shapes["decoder_sparse_step"] = 2  # layers 1, 3, ... sparse
    elif num_layers > 1 and rng.random() < 0.4:
        shapes["mlp_only_layers"] = [rng.randrange(num_layers)]
    if arch == "qwen2_moe":
        shapes["shared_expert_intermediate_size"] = rng.choice([0, 32, 48])
    return shapes


def draw_model(seed: int) -> ModelSpec:
    """The architecture and shapes of model ``seed`` (architectures in turn, so every one is drawn often)."""
    rng = random.Random(f"parity-model-{seed}")
    arch = ARCHITECTURE_NAMES[seed % len(ARCHITECTURE_NAMES)]
    num_heads = rng.choice([1, 2, 4, 6, 8])
    num_kv_heads = rng.choice([d for d in range(1, num_heads + 1) if num_heads % d == 0])
    num_layers = rng.randint(1, 3)
    if arch in VISION_ARCHITECTURES:  # the vision tower's sizes are fixed by tiny_vision_model
        num_heads = rng.choice([2, 4])
        num_kv_heads = rng.choice([1, 2])
        head_dim = 16 if arch == "llava" else rng.choice([16, 32])  # Qwen-VL splits head_dim / 2 in 1:3:3 (x 1/8)
        return ModelSpec(seed, arch, dict(hidden_size=num_heads * head_dim, num_heads=num_heads,
                                          num_kv_heads=num_kv_heads, num_layers=num_layers,
                                          intermediate_size=rng.choice([32, 64, 96])))
    shapes: dict[str, Any] = dict(
        hidden_size=rng.choice([16, 32, 48, 64]), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=rng.choice([8, 12, 16, 32]), num_layers=num_layers, intermediate_size=rng.choice([24, 64, 96]),
        tie_word_embeddings=rng.random() < 0.4, initializer_range=rng.choice([0.05, 0.1, 0.15]),
        rms_norm_eps=rng.choice([1e-6, 1e-5]), rope_parameters=_rope(rng))
    if arch == "mistral" and rng.random() < 0.5:
        shapes["sliding_window"] = rng.choice([48, 64])  # caps the engine's context: requests stay inside it
    if arch in MOE_ARCHITECTURES:
        shapes.update(_experts(arch, rng, num_layers))
    return ModelSpec(seed, arch, shapes)


def _randomise_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))


def _model_class(spec: ModelSpec) -> type:
    return transformers.AutoModelForImageTextToText if spec.vision else transformers.AutoModelForCausalLM


def _liked_token(model: torch.nn.Module, spec: ModelSpec) -> int:
    """The token greedy decoding of a random prompt emits most (it becomes a second EOS id)."""
    rng = random.Random(spec.seed)
    ids = torch.tensor([[rng.randrange(8, 500) for _ in range(12)]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    generated = out[0, ids.shape[1]:].tolist()
    return max(set(generated), key=generated.count)


def write_model(spec: ModelSpec, directory: Path) -> Path:
    """Write model ``spec`` (weights, tokenizer, processor) to ``directory``."""
    shapes = dict(spec.shapes)
    text_only = {k: shapes.pop(k) for k in list(shapes) if k not in
                 ("hidden_size", "num_heads", "num_kv_heads", "num_layers", "intermediate_size",
                  "tie_word_embeddings")}
    make_tiny_model(directory, seed=spec.seed, arch=spec.arch, max_position_embeddings=MAX_POSITIONS,
                    **shapes, **({} if spec.vision else text_only))
    model = _model_class(spec).from_pretrained(directory, dtype=torch.float32).eval()
    _randomise_norms_and_biases(model, spec.seed)
    model.save_pretrained(directory, safe_serialization=True)
    eos = model.config.get_text_config().eos_token_id
    extra = _liked_token(model, spec)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted({eos, extra})}))
    return directory


@dataclass
class LoadedModel:
    """A written model and what cases load from it: the reference per (device, dtype), the engine's weights."""

    spec: ModelSpec
    directory: Path
    references: dict[tuple[str, torch.dtype], torch.nn.Module] = field(default_factory=dict)
    engines: dict[tuple[str, torch.dtype], DynamicInferenceEngine] = field(default_factory=dict)

    def reference(self, device: str, dtype: torch.dtype) -> torch.nn.Module:
        key = (device, dtype)
        if key not in self.references:
            loaded = _model_class(self.spec).from_pretrained(self.directory, dtype=dtype)
            self.references[key] = loaded.to(device).eval()
        return self.references[key]

    def weights(self, device: str, dtype: torch.dtype) -> DynamicInferenceEngine:
        """An engine whose model and tokenizer the cases' own engines share (loading once per model)."""
        key = (device, dtype)
        if key not in self.engines:
            self.engines[key] = DynamicInferenceEngine.from_model_dir(
                self.directory, InferenceConfig(dtype=dtype, device=device, num_kv_blocks=1, enable_cuda_graphs=False))
        return self.engines[key]

    @functools.cached_property
    def adapter(self) -> Path:
        """A rank-4 PEFT adapter of this model, written with ``peft`` (attention only on MoE models, whose shared
        experts take no adapter), for the LoRA rows of the search against itself."""
        from ..lora_adapters import make_peft_adapter  # noqa: PLC0415 - peft only where a LoRA row runs

        moe = self.spec.arch in MOE_ARCHITECTURES
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if moe else None
        return written_once(self.directory / "lora-adapter", lambda scratch: make_peft_adapter(
            self.directory, scratch, rank=4, seed=self.spec.seed, targets=targets))

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer (it expands image placeholders the way the engine receives prompts)."""
        return Tokenizer.from_pretrained(self.directory)

    @functools.cached_property
    def eos_ids(self) -> tuple[int, ...]:
        """EOS as ``transformers`` reads it: the tokenizer's, and ``generation_config.json``'s list."""
        eos = transformers.GenerationConfig.from_pretrained(self.directory).eos_token_id
        ids = {self.tokenizer.hf_tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
        return tuple(sorted(i for i in ids if i is not None))

    @functools.cached_property
    def processor(self) -> Any:
        """LLaVA's processor, or Qwen-VL's image processor (its processor object needs torchvision)."""
        load = transformers.AutoProcessor if self.spec.arch == "llava" else transformers.AutoImageProcessor
        return load.from_pretrained(self.directory)


class ModelPool:
    """Models by seed: written once per session (in a directory the session's workers share), the last few kept
    loaded."""

    def __init__(self, root: Path):
        self.root = root
        self._written: dict[int, Path] = {}
        self._loaded: OrderedDict[int, LoadedModel] = OrderedDict()

    def get(self, seed: int) -> LoadedModel:
        if seed in self._loaded:
            self._loaded.move_to_end(seed)
            return self._loaded[seed]
        spec = draw_model(seed)
        if seed not in self._written:
            self._written[seed] = written_once(self.root / f"model-{seed}", lambda scratch: write_model(spec, scratch))
        self._loaded[seed] = LoadedModel(spec, self._written[seed])
        while len(self._loaded) > LOADED_MODELS:
            self._loaded.popitem(last=False)
        return self._loaded[seed]
