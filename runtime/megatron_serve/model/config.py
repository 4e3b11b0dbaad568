"""Reading a Hugging Face ``config.json`` into the few numbers the decoder needs.

Every architecture or value we cannot run faithfully is refused here, at load, with one line that
names it; silently running a different model is the worst failure an inference engine can have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import UnsupportedModelError
from .families import ARCHITECTURES, Family, MoEConfig
from .quantization import QuantizationConfig, parse_quantization
from .vision.config import VISION_LANGUAGE_ARCHITECTURES, VisionConfig, is_vision_language, split_vision_language

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
SUPPORTED_ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None
    torch_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    vision: VisionConfig | None = None  # the vision side of a vision-language model (see vision_config)
    moe: MoEConfig | None = None  # the experts of a mixture-of-experts model
    quantization: QuantizationConfig | None = None  # FP8 layers (see quantization); None: unquantized
    num_nextn_predict_layers: int = 0  # MTP layers stored after the decoder's (``model.layers.{num_layers}``...)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        architectures = raw.get("architectures") or []
        if is_vision_language(raw):
            text, vision = split_vision_language(raw)
            return replace(cls.from_dict(text), architecture=architectures[0], vision=vision,
                           quantization=parse_quantization(raw.get("quantization_config")))
        if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
            known = [*ARCHITECTURES, *VISION_LANGUAGE_ARCHITECTURES]
            raise UnsupportedModelError(f"unsupported architecture {architectures!r}: expected one of {', '.join(known)}")
        architecture = architectures[0]
        family = ARCHITECTURES[architecture]
        activation = raw.get("hidden_act", "silu")
        if activation not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported hidden_act {activation!r}: only 'silu' (SwiGLU) is implemented")
        if raw.get("attention_bias") and not family.qkv_bias:
            raise UnsupportedModelError("attention_bias=true is only supported for Qwen2 models")
        if raw.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        hidden_size = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        sliding_window = _sliding_window(raw, family)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=architecture,
            family=family.name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias and bool(raw.get("qkv_bias", True)),
            qk_norm=family.qk_norm,
            rope=_rope_config(raw),
            sliding_window=sliding_window,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=eos_ids,
            moe=None if family.experts is None else family.experts(raw),
            quantization=parse_quantization(raw.get("quantization_config")),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        )

    @property
    def max_context(self) -> int:
        """Longest sequence this model can attend over exactly (a sliding window caps it)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _sliding_window(raw: dict[str, Any], family: Family) -> int | None:
    window = raw.get("sliding_window")
    if window is None:
        return None
    if family.window_needs_flag:
        return int(window) if raw.get("use_sliding_window") else None
    return int(window)


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    """Read both the classic ``rope_theta``/``rope_scaling`` keys and the newer ``rope_parameters``."""
    params: dict[str, Any] = {}
    if isinstance(raw.get("rope_parameters"), dict):
        params.update(raw["rope_parameters"])
    if isinstance(raw.get("rope_scaling"), dict):
        params.update(raw["rope_scaling"])
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope type {rope_type!r}: expected one of {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )
