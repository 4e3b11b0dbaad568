"""Dispatcher: the engine calls these names; they route to Triton on CUDA, and elsewhere to the CPU kernels
(:mod:`megatron_kernels.cpu_attention`, :mod:`megatron_kernels.cpu_rows`) where one exists and to the reference
for the rest.

``MEGATRON_KERNELS=triton``, ``=cpu`` or ``=reference`` forces one backend (Triton on CPU needs
``TRITON_INTERPRET=1``; ``reference`` is plain PyTorch throughout, nothing compiled).
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from . import cpu_attention, cpu_rows, reference

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

BACKENDS = ("triton", "cpu", "reference")

#: The ops the ``cpu`` backend computes with a kernel of its own; the others are the reference's.
CPU_OPS = {
    "paged_attention_decode": cpu_attention.paged_attention_decode,
    "paged_attention_prefill": cpu_attention.paged_attention_prefill,
    "apply_rotary_write_kv_cache": cpu_rows.apply_rotary_write_kv_cache,
    "rms_norm": cpu_rows.rms_norm,
    "fused_add_rms_norm": cpu_rows.fused_add_rms_norm,
    "silu_and_mul": cpu_rows.silu_and_mul,
}


def backend_for(device: torch.device | str) -> str:
    """Which implementation serves tensors on ``device``: one of :data:`BACKENDS`."""
    forced = os.environ.get("MEGATRON_KERNELS", "").strip().lower()
    if forced in BACKENDS:
        return forced
    if forced:
        raise ValueError(f"MEGATRON_KERNELS must be one of {', '.join(BACKENDS)}, got {forced!r}")
    kind = torch.device(device).type
    if kind == "cuda" and _triton_ops() is not None:
        return "triton"
    return "cpu" if kind == "cpu" else "reference"


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
    backend = backend_for(device)
    if backend == "triton":
        module = _triton_ops()
        if module is None:
            raise RuntimeError("MEGATRON_KERNELS=triton but triton is not installed (pip install triton)")
        return getattr(module, name)
    if backend == "cpu" and name in CPU_OPS:
        return CPU_OPS[name]
    return getattr(reference, name)
