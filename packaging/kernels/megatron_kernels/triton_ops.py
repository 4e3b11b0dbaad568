"""Triton implementations of every dispatcher op, with the reference signatures.

Each kernel lives in its own module; this module only gathers them under the names that
:mod:`megatron_kernels.ops` resolves. Importing it requires ``triton`` (the dispatcher falls back to the
reference when that import fails).
"""

from __future__ import annotations

from .triton_activation import silu_and_mul
from .triton_decode_attention import paged_attention_decode
from .triton_fp8_linear import fp8_linear
from .triton_kv_cache import write_kv_cache
from .triton_lora import lora_expand, lora_shrink
from .triton_moe import fused_moe
from .triton_norm import fused_add_rms_norm, rms_norm
from .triton_prefill_attention import paged_attention_prefill
from .triton_rotary import apply_rotary, apply_rotary_write_kv_cache

__all__ = [
    "apply_rotary",
    "apply_rotary_write_kv_cache",
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_moe",
    "lora_expand",
    "lora_shrink",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "silu_and_mul",
    "write_kv_cache",
]
