"""Decode attention on a CPU that reads the paged KV cache in place: a C++ kernel, built on first use.

:func:`megatron_kernels.reference.paged_attention_decode` gathers each sequence's keys and values into a copy
and multiplies the copy, so a decode step moves the cache through memory three times; the kernel
(``csrc/paged_attention_decode.cpp``) walks each sequence's block table and reads every key and value once
(the offline benchmark's figures are in docs/benchmarks.md). Each sequence is summed in an order fixed by
its own context alone, so its row does not change with the batch around it.

The kernel is compiled by ``torch.utils.cpp_extension`` (a C++ compiler and ``ninja``) for this machine's
instruction set, once per source and CPU, into torch's extensions directory (``TORCH_EXTENSIONS_DIR``). Where it
cannot be built, decode attention stays on the reference, with one warning that says why. It serves float32
queries over a float32 cache; any other call (a 16-bit model's, an FP8 cache's scales) goes to the reference.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import subprocess
from pathlib import Path
from typing import Callable

import torch

from . import reference

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_decode.cpp"

logger = logging.getLogger(__name__)


def _machine_tag() -> str:
    """A short digest of this CPU's instruction set: ``-march=native`` code built on one CPU may not run on another
    (a home directory shared between machines), so each kind builds its own."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def compile_flags() -> list[str]:
    """The compiler's flags: this CPU's whole instruction set; ``-ffast-math`` lets the compiler reorder each row's
    sums into vector lanes and vectorize ``exp`` (the order is still fixed by the row's own length). It is a
    compile flag only: linked into a shared library it would switch the whole process to flushing denormals
    (``crtfastmath``), and torch links with its own flags. On x86, full-width AVX-512 registers, which GCC
    otherwise avoids on Intel CPUs (about 1.3x on this kernel, docs/benchmarks.md)."""
    flags = ["-O3", "-march=native", "-ffast-math"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-mprefer-vector-width=512")
    return flags


@functools.cache
def kernel() -> Callable[..., None] | None:
    """``torch.ops.megatron_cpu.paged_attention_decode``, built and loaded on first call; None where it cannot be."""
    try:
        from torch.utils import cpp_extension  # noqa: PLC0415 - imports setuptools; only when a CPU engine needs it

        cpp_extension.load(name=f"megatron_cpu_attention_{_machine_tag()}", sources=[str(SOURCE)],
                           extra_cflags=compile_flags(), is_python_module=False)
    except (ImportError, OSError, RuntimeError, subprocess.CalledProcessError) as error:
        logger.warning("the CPU decode-attention kernel could not be built (%s); decode attention runs the PyTorch "
                       "reference (slower). It needs a C++ compiler, ninja and setuptools.", str(error).splitlines()[0])
        return None
    return torch.ops.megatron_cpu.paged_attention_decode


def _kernel_serves(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   k_scales: torch.Tensor | None) -> bool:
    """Whether the kernel computes this call: float32 queries and cache on the CPU, rows of contiguous values."""
    return (k_scales is None and q.device.type == "cpu"
            and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`megatron_kernels.reference.paged_attention_decode` through the C++ kernel where it serves the call."""
    op = kernel() if _kernel_serves(q, k_cache, v_cache, k_scales) else None
    if op is None:
        return reference.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out=out,
                                                k_scales=k_scales, v_scales=v_scales)
    result = out if out is not None and out.stride(-1) == 1 else torch.empty_like(q)
    op(q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous(),
       scale, result)
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result
