"""PEFT LoRA checkpoints (``adapter_config.json`` + ``adapter_model.safetensors``), read and checked
against the base model before anything is loaded anywhere.

An adapter may touch the attention projections (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) and the
dense MLP's (``gate_proj``, ``up_proj``, ``down_proj``) of any decoder layer. Everything else a PEFT
checkpoint can hold (embeddings, the LM head, MoE experts, DoRA magnitudes, biases, ``modules_to_save``,
per-module ``rank_pattern``) is refused with :class:`LoraAdapterError` naming it: an adapter served
without one of its parts would give other tokens than it was trained for, silently.

The scaling is PEFT's: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file

from .config import ModelConfig

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight")
# PEFT options that change what the adapter computes: each must have its neutral value.
_NEUTRAL = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False, "modules_to_save": None,
            "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "layer_replication": None,
            "target_parameters": None, "trainable_token_indices": None}


class LoraAdapterError(ValueError):
    """An adapter this engine cannot serve exactly; the message names the adapter and the problem."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights: ``weights[(layer, projection)] = (A [r, in], B [out, r] * scaling)``."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def projection_shape(config: ModelConfig, layer: int, projection: str) -> tuple[int, int] | None:
    """``(out_features, in_features)`` of a projection in the base model; None where the layer has none."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    if projection in MLP_PROJECTIONS and config.moe is not None and config.moe.is_sparse(layer):
        return None  # an expert layer: its MLP is the experts, which adapters cannot reach yet
    hidden, inner = config.hidden_size, config.intermediate_size
    return {"q_proj": (q_size, hidden), "k_proj": (kv_size, hidden), "v_proj": (kv_size, hidden),
            "o_proj": (hidden, q_size), "gate_proj": (inner, hidden), "up_proj": (inner, hidden),
            "down_proj": (hidden, inner)}[projection]


def adapter_scaling(name: str, rank: object, alpha: object, use_rslora: bool, targets: object,
                    max_rank: int) -> float:
    """PEFT's scaling of adapter ``name`` from its config values; :class:`LoraAdapterError` when they cannot be served."""
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(PROJECTIONS))
        if unknown:
            raise LoraAdapterError(f"LoRA adapter {name!r}: target_modules {unknown} are not supported "
                                   f"(only {', '.join(PROJECTIONS)})")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraAdapterError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraAdapterError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraAdapterError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    return float(alpha / math.sqrt(rank) if use_rslora else alpha / rank)


def _read_config(name: str, directory: Path, max_rank: int) -> tuple[int, float]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise LoraAdapterError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {directory}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {path} is not JSON: {exc}") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"LoRA adapter {name!r}: peft_type {raw['peft_type']!r} is not LORA")
    for key, neutral in _NEUTRAL.items():
        value = raw.get(key, neutral)
        if value and value != neutral:  # PEFT writes an empty list or mapping, or null, for "not used"
            raise LoraAdapterError(f"LoRA adapter {name!r}: {key}={raw[key]!r} is not supported")
    rank = raw.get("r")
    scaling = adapter_scaling(name, rank, raw.get("lora_alpha", 8), bool(raw.get("use_rslora")),
                              raw.get("target_modules"), max_rank)
    return int(rank), scaling


def check_shapes(name: str, shapes: Iterable[tuple[str, tuple[int, ...]]], config: ModelConfig, rank: int,
                 targets: list[str] | None = None) -> list[tuple[int, str]]:
    """The ``(layer, projection)`` pairs that tensors of PEFT names and these shapes fill in the base model
    ``config``, in the order given; :class:`LoraAdapterError` naming the first that does not fit (reads no data)."""
    halves: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes:
        match = _KEY.fullmatch(key)
        if match is None or match[3] not in PROJECTIONS:
            raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {key} is not a LoRA weight of an attention "
                                   f"or MLP projection ({', '.join(PROJECTIONS)})")
        layer, projection = int(match[1]), match[3]
        if targets is not None and projection not in targets:
            raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {key} is outside target_modules {targets}")
        if (projection_shape(config, layer, projection) if layer < config.num_layers else None) is None:
            raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {key} names a module the base model does not have")
        pair = halves.setdefault((layer, projection), {})
        if match[4] in pair:
            raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {key} is given twice")
        pair[match[4]] = tuple(shape)
    for (layer, projection), pair in halves.items():
        where = f"layers.{layer}.{projection}"
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(f"LoRA adapter {name!r}: {where} has lora_{''.join(pair)} without its pair")
        out_features, in_features = projection_shape(config, layer, projection)
        if pair["A"] != (rank, in_features) or pair["B"] != (out_features, rank):
            raise LoraAdapterError(f"LoRA adapter {name!r}: {where} has lora_A {pair['A']} and lora_B "
                                   f"{pair['B']}; the base model needs ({rank}, {in_features}) and "
                                   f"({out_features}, {rank})")
    if not halves:
        raise LoraAdapterError(f"LoRA adapter {name!r} holds no LoRA weights")
    return list(halves)


def adapter_of(name: str, path: str, rank: int, scaling: float, named: Iterable[tuple[str, torch.Tensor]],
               config: ModelConfig) -> LoraAdapter:
    """Adapter ``name`` from ``(PEFT name, tensor)`` pairs (copied, float32), checked against ``config``."""
    tensors = {key: tensor.detach().to(torch.float32, copy=True) for key, tensor in named}
    check_shapes(name, ((key, tuple(t.shape)) for key, t in tensors.items()), config, rank)
    weights = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        weights.setdefault((int(match[1]), match[3]), {})[match[4]] = tensor
    return LoraAdapter(name, path, rank, scaling,
                       {where: (pair["A"], pair["B"] * scaling) for where, pair in sorted(weights.items())})


def read_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check adapter ``name`` at ``path`` against the base model ``config``."""
    directory = Path(path)
    if not directory.is_dir():
        raise LoraAdapterError(f"LoRA adapter {name!r}: {directory} is not a directory")
    rank, scaling = _read_config(name, directory, max_rank)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoraAdapterError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {directory}")
    return adapter_of(name, str(directory), rank, scaling, load_file(weights_path).items(), config)
