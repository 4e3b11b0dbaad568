"""PEFT LoRA checkpoints (``adapter_config.json`` + ``adapter_model.safetensors``), read and checked
against the base model before anything is loaded anywhere.

An adapter may touch the attention projections (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) and the
dense MLP's (``gate_proj``, ``up_proj``, ``down_proj``) of any decoder layer, and the experts of an MoE
layer through ``target_parameters`` (:mod:`.lora_experts`). Everything else a PEFT checkpoint can hold
(embeddings, the LM head, a shared expert, DoRA magnitudes, biases, ``modules_to_save``, per-module
``rank_pattern``) is refused with :class:`LoraAdapterError` naming it: an adapter served
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

from ..finite import NonFiniteWeights, refuse_nonfinite
from ...wire.lora_names import directory_problem, shown
from ..config import ModelConfig
from .experts import EXPERT_PROJECTIONS, expert_key, expert_shape, expert_targets, per_expert

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # a PEFT adapter_config.json is a few hundred bytes to a few KiB
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight")
# PEFT options that change what the adapter computes: each must have its neutral value.
_NEUTRAL = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False, "modules_to_save": None,
            "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "layer_replication": None,
            "trainable_token_indices": None}


class LoraAdapterError(ValueError):
    """An adapter this engine cannot serve exactly; the message names the adapter and the problem."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights: ``weights[(layer, projection)] = (A [r, in], B [out, r] * scaling)``; an expert
    projection's (:data:`.lora_experts.EXPERT_PROJECTIONS`) are stacked per expert, ``[E, r, in]`` and
    ``[E, out, r]``."""

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


def adapter_experts(name: str, target_parameters: object) -> tuple[str, ...]:
    """The expert projections an adapter's ``target_parameters`` targets, in module order; :class:`LoraAdapterError`
    when it names another parameter."""
    targets = expert_targets(target_parameters)
    if targets is None:
        raise LoraAdapterError(f"LoRA adapter {name!r}: target_parameters {target_parameters!r} are not supported "
                               f"(only the MoE experts' mlp.{' and mlp.'.join(EXPERT_PROJECTIONS)})")
    return targets


def adapter_scaling(name: str, rank: object, alpha: object, use_rslora: bool, targets: object,
                    max_rank: int) -> float:
    """PEFT's scaling of adapter ``name`` from its config values; :class:`LoraAdapterError` when they cannot be
    served."""
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


def _read_config(name: str, path: Path, max_rank: int) -> tuple[int, float, tuple[str, ...]]:
    try:
        raw = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise LoraAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"LoRA adapter {name!r}: peft_type {raw['peft_type']!r} is not LORA")
    for key, neutral in _NEUTRAL.items():
        value = raw.get(key, neutral)
        if value and value != neutral:  # PEFT writes an empty list or mapping, or null, for "not used"
            raise LoraAdapterError(f"LoRA adapter {name!r}: {key}={raw[key]!r} is not supported")
    rank = raw.get("r")
    scaling = adapter_scaling(name, rank, raw.get("lora_alpha", 8), bool(raw.get("use_rslora")),
                              raw.get("target_modules"), max_rank)
    return int(rank), scaling, adapter_experts(name, raw.get("target_parameters"))


def _needed(config: ModelConfig, layer: int, projection: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of ``lora_A`` and ``lora_B`` a projection needs (PEFT's, before :func:`per_expert`)."""
    if projection in EXPERT_PROJECTIONS:
        experts, out_features, in_features = expert_shape(config, layer, projection)
        return (rank * experts, in_features), (out_features, rank * experts)
    out_features, in_features = projection_shape(config, layer, projection)
    return (rank, in_features), (out_features, rank)


def check_shapes(name: str, shapes: Iterable[tuple[str, tuple[int, ...]]], config: ModelConfig, rank: int,
                 targets: list[str] | None = None, experts: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """The ``(layer, projection)`` pairs that tensors of PEFT names and these shapes fill in the base model
    ``config``, in the order given; :class:`LoraAdapterError` naming the first that does not fit (reads no data).
    ``experts``: the expert projections the adapter's ``target_parameters`` targets (:func:`adapter_experts`)."""
    halves: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes:
        expert = expert_key(key, experts)
        if expert is not None:
            layer, projection, half = expert
            if (expert_shape(config, layer, projection) if layer < config.num_layers else None) is None:
                raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {key} names experts the base model does "
                                       "not have")
            pair = halves.setdefault((layer, projection), {})
            if half in pair:
                raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {key} is given twice")
            pair[half] = tuple(shape)
            continue
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
        need_a, need_b = _needed(config, layer, projection, rank)
        if pair["A"] != need_a or pair["B"] != need_b:
            raise LoraAdapterError(f"LoRA adapter {name!r}: {where} has lora_A {pair['A']} and lora_B "
                                   f"{pair['B']}; the base model needs {need_a} and {need_b}")
    if not halves:
        raise LoraAdapterError(f"LoRA adapter {name!r} holds no LoRA weights")
    return list(halves)


def adapter_of(name: str, path: str, rank: int, scaling: float, named: Iterable[tuple[str, torch.Tensor]],
               config: ModelConfig, experts: tuple[str, ...] = ()) -> LoraAdapter:
    """Adapter ``name`` from ``(PEFT name, tensor)`` pairs (copied, float32), checked against ``config``."""
    tensors = {key: tensor.detach().to(torch.float32, copy=True) for key, tensor in named}
    check_shapes(name, ((key, tuple(t.shape)) for key, t in tensors.items()), config, rank, experts=experts)
    try:
        refuse_nonfinite(tensors.items(), f"LoRA adapter {name!r}")
    except NonFiniteWeights as exc:
        raise LoraAdapterError(str(exc)) from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        expert = expert_key(key, experts)
        if expert is not None:
            halves.setdefault(expert[:2], {})[expert[2]] = tensor
        else:
            match = _KEY.fullmatch(key)
            halves.setdefault((int(match[1]), match[3]), {})[match[4]] = tensor
    weights = {}
    for (layer, projection), pair in sorted(halves.items()):
        a, b = pair["A"], pair["B"]
        if projection in EXPERT_PROJECTIONS:
            a, b = per_expert(a, b, config.moe.num_experts)
        weights[(layer, projection)] = (a, b * scaling)
    return LoraAdapter(name, path, rank, scaling, weights)


def max_adapter_bytes(config: ModelConfig, max_rank: int) -> int:
    """The largest ``adapter_model.safetensors`` an engine may read: every projection it can adapt at ``max_rank``,
    float64 (the widest dtype PEFT writes), plus :data:`MAX_CONFIG_BYTES` for the file's header. Anything larger
    cannot be an adapter this engine serves, so it is refused from its size before a byte is read."""
    elements = 0
    for layer in range(config.num_layers):
        for projection in PROJECTIONS:
            shape = projection_shape(config, layer, projection)
            if shape is not None:
                elements += max_rank * sum(shape)
        for projection in EXPERT_PROJECTIONS:
            shape = expert_shape(config, layer, projection)
            if shape is not None:
                experts, out_features, in_features = shape
                elements += max_rank * experts * (out_features + in_features)
    return elements * 8 + MAX_CONFIG_BYTES


def _file_of(name: str, directory: Path, filename: str, limit: int) -> Path:
    """``directory/filename``, refused when missing or over ``limit`` bytes (from its metadata, nothing read)."""
    path = directory / filename
    if not path.is_file():
        raise LoraAdapterError(f"LoRA adapter {name!r}: no {filename} in {shown(str(directory))}")
    size = path.stat().st_size
    if size > limit:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {filename} is {size} bytes, above the {limit} an adapter of "
                               "this model can need; nothing was read")
    return path


def read_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check adapter ``name`` at ``path`` against the base model ``config``; the files' sizes are checked
    before either is read (:data:`MAX_CONFIG_BYTES`, :func:`max_adapter_bytes`)."""
    directory = Path(path)
    problem = directory_problem(name, directory)
    if problem is not None:
        raise LoraAdapterError(problem)
    config_path = _file_of(name, directory, CONFIG_FILE, MAX_CONFIG_BYTES)
    weights_path = _file_of(name, directory, WEIGHTS_FILE, max_adapter_bytes(config, max_rank))
    rank, scaling, experts = _read_config(name, config_path, max_rank)
    return adapter_of(name, str(directory), rank, scaling, load_file(weights_path).items(), config, experts)
