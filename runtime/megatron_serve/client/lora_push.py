"""What ``WeightSender.send_lora`` sends (and ``send(..., adapters=...)`` with the policy): a LoRA adapter's tensors
under PEFT's names, and its config.

A trainer holds an adapter in one of three shapes: a PEFT model, its state dict (with or without the
adapter's name in the keys: ``...q_proj.lora_A.default.weight`` or ``...q_proj.lora_A.weight``), or plain
``{module: (A, B)}`` pairs (an MoE layer's experts: ``{"model.layers.0.mlp.experts": (A, B)}`` with
``target_parameters`` naming the one expert parameter they adapt). All become ``(PEFT name, tensor)`` pairs as
a saved checkpoint names them
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``); every engine checks them against
its base model before any byte moves (:func:`megatron_serve.model.lora.checkpoint.check_shapes`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Union

import torch
from safetensors.torch import load_file

from ..wire.rendezvous import LoraPush

#: A PEFT model, a PEFT state dict, or ``{module path: (lora_A, lora_B)}``.
LoraWeights = Union[Any, Mapping[str, torch.Tensor], Mapping[str, tuple[torch.Tensor, torch.Tensor]]]

_ADAPTER_IN_NAME = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")  # PEFT's in-memory names carry the adapter's
_PREFIX = "base_model.model."


def _peft_name(key: str) -> str:
    key = _ADAPTER_IN_NAME.sub(r".lora_\1.weight", key)
    return key if key.startswith(_PREFIX) else _PREFIX + key


def _from_peft_model(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The active adapter's tensors and config values of a ``peft.PeftModel``."""
    from peft import get_peft_model_state_dict  # noqa: PLC0415 - only a trainer that holds a PEFT model has peft

    adapter = model.active_adapter
    config = model.peft_config[adapter]
    targets, parameters = config.target_modules, config.target_parameters
    values = {"rank": config.r, "alpha": config.lora_alpha, "use_rslora": bool(config.use_rslora),
              "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) and targets else None,
              "target_parameters": sorted(parameters) if parameters else None}
    return dict(get_peft_model_state_dict(model, adapter_name=adapter)), values


def adapter_push(name: str, weights: LoraWeights, *, version: int, rank: int | None, alpha: float | None,
                 use_rslora: bool, target_modules: list[str] | None, target_parameters: list[str] | None = None
                 ) -> tuple[list[tuple[str, torch.Tensor]], LoraPush]:
    """The named tensors and the push of adapter ``name`` version ``version``; ``ValueError`` naming what is wrong."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a LoRA adapter needs a non-empty name, got {name!r}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an integer >= 0, got {version!r}")
    if hasattr(weights, "peft_config"):
        tensors, values = _from_peft_model(weights)
        rank = values["rank"] if rank is None else rank
        alpha = values["alpha"] if alpha is None else alpha
        use_rslora = use_rslora or values["use_rslora"]
        target_modules = target_modules or values["target_modules"]
        target_parameters = target_parameters or values["target_parameters"]
    elif isinstance(weights, Mapping):
        tensors = {}
        for key, value in weights.items():
            if isinstance(value, tuple):
                if len(value) != 2:
                    raise ValueError(f"LoRA module {key!r}: give (lora_A, lora_B), got {len(value)} tensors")
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = value
            else:
                tensors[key] = value
    else:
        raise ValueError(f"LoRA weights must be a PEFT model, a state dict or {{module: (A, B)}}, "
                         f"got {type(weights).__name__}")
    if rank is None or alpha is None:
        raise ValueError(f"LoRA adapter {name!r}: give rank and alpha (or a PEFT model, whose config has them)")
    named = [(_peft_name(key), tensor) for key, tensor in tensors.items()]
    push = LoraPush(name=name, version=version, rank=int(rank), alpha=float(alpha), use_rslora=bool(use_rslora),
                    target_modules=list(target_modules) if target_modules else None,
                    target_parameters=list(target_parameters) if target_parameters else None)
    return named, push


def _config_values(config: Any) -> dict[str, Any]:
    """``adapter_push``'s keywords from a ``peft.LoraConfig`` or an ``adapter_config.json`` mapping."""
    get = config.get if isinstance(config, Mapping) else (lambda key, default=None: getattr(config, key, default))
    targets, parameters = get("target_modules"), get("target_parameters")
    return {"rank": get("r"), "alpha": get("lora_alpha"), "use_rslora": bool(get("use_rslora", False)),
            "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) and targets else None,
            "target_parameters": sorted(parameters) if parameters else None}


def adapter_update(name: str, value: Any, version: int) -> tuple[list[tuple[str, torch.Tensor]], LoraPush]:
    """Adapter ``name``'s tensors and push (version ``version``) for a policy refit (``WeightSender.send(...,
    adapters=...)``) from a PEFT model, a PEFT directory (``adapter_config.json`` and
    ``adapter_model.safetensors``, what ``save_pretrained`` writes), or ``(state dict, config)`` with a
    ``peft.LoraConfig`` or the mapping of an ``adapter_config.json``; ``ValueError`` naming what is wrong."""
    if isinstance(value, (str, os.PathLike)):
        directory = Path(value)
        try:
            config = json.loads((directory / "adapter_config.json").read_text())
            tensors: Any = load_file(str(directory / "adapter_model.safetensors"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"LoRA adapter {name!r}: cannot read a PEFT adapter from {str(directory)!r}: {exc}") from exc
        return adapter_push(name, tensors, version=version, **_config_values(config))
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Mapping):
        return adapter_push(name, value[0], version=version, **_config_values(value[1]))
    if hasattr(value, "peft_config"):
        return adapter_push(name, value, version=version, rank=None, alpha=None, use_rslora=False,
                            target_modules=None)
    raise ValueError(f"LoRA adapter {name!r}: give a PEFT model, a PEFT directory or (state dict, LoraConfig), "
                     f"got {type(value).__name__}")
