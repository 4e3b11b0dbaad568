"""Dispatcher: the engine calls these names; they route to Triton on CUDA and to the reference elsewhere.

``MEGATRON_KERNELS=triton`` or ``=reference`` forces one backend (Triton on CPU needs ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from . import reference

OP_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "apply_rotary",
    "apply_rotary_write_kv_cache",
    "write_kv_cache",
    "paged_attention_decode",
    "paged_attention_prefill",
    "fused_moe",
    "fp8_linear",
    "lora_shrink",
    "lora_expand",
)


def backend_for(device: torch.device | str) -> str:
    """Which implementation serves tensors on ``device``: ``"triton"`` or ``"reference"``."""
    forced = os.environ.get("MEGATRON_KERNELS", "").strip().lower()
    if forced in ("triton", "reference"):
        return forced
    if forced:
        raise ValueError(f"MEGATRON_KERNELS must be 'triton' or 'reference', got {forced!r}")
    return "triton" if torch.device(device).type == "cuda" and _triton_ops() is not None else "reference"


def _triton_ops():
    try:
        from . import triton_ops  # noqa: PLC0415 - optional dependency, imported on first use
    except ImportError:
        return None
    return triton_ops


def get_op(name: str, device: torch.device | str) -> Callable:
    """The implementation of op ``name`` for ``device``; resolve once per model, not per call."""
    if name not in OP_NAMES:
        raise KeyError(f"unknown op {name!r}")
    if backend_for(device) == "triton":
        module = _triton_ops()
        if module is None:
            raise RuntimeError("MEGATRON_KERNELS=triton but triton is not installed (pip install triton)")
        return getattr(module, name)
    return getattr(reference, name)
