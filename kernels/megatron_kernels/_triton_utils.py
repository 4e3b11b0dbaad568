"""Launch helpers shared by the Triton kernel modules: tile sizing, dtype mapping, device facts.

The same kernels run compiled on a GPU and under ``TRITON_INTERPRET=1`` on CPU. The interpreter pays
about 1.5 ms per program instance, so on CPU the launchers pick large tiles and small grids; on a GPU
they pick tiles that keep registers and shared memory within budget.

Integer arguments that change from one engine step to the next (row and token counts, the block
table's width) are in each kernel's ``do_not_specialize``. Triton otherwise compiles one variant per
class of the value (1, a multiple of 16, other), and a class first met mid-serving stalled the step:
on an H100 a new prefill-kernel variant took 1.8-2.2 s to compile, and the first pass of
``benchmarks/vlm.py``'s LLaVA chats after an untimed one took 2.18 s instead of 0.36 s.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


def tl_dtype(dtype: torch.dtype):
    """The Triton dtype of a floating-point torch dtype the kernels support."""
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype for Triton kernels: {dtype}") from None


def interpreted(t: torch.Tensor) -> bool:
    """True when ``t`` is served by the Triton interpreter (any non-CUDA tensor)."""
    return t.device.type != "cuda"


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


#: ``tl.dot`` on a GPU takes no reduction dimension under 16 (the interpreter takes any): a head of 8 is padded.
MIN_DOT_K = 16


def dot_width(n: int) -> int:
    """The tile width of a dimension that ``tl.dot`` reduces over (a head's): a power of two, at least 16."""
    return max(MIN_DOT_K, next_pow2(n))


def min_dot_k(dtype: torch.dtype) -> int:
    """The smallest reduction dimension a GPU's ``tl.dot`` takes on operands of ``dtype``: 32 for 8-bit (FP8
    tensor cores), 16 for 16-bit, 8 for float32 (Triton's NVIDIA backend, ``min_dot_size``).

    The interpreter takes any, so launchers check their tiles against this on every device: a tile a GPU
    would refuse to compile fails the CPU tests too.
    """
    return {1: 32, 2: 16, 4: 8}[dtype.itemsize]


def tile_budget(t: torch.Tensor) -> int:
    """Elements one program may hold in a 2-D/3-D tile: large under the interpreter, register-sized on GPU."""
    return 1 << 16 if interpreted(t) else 1 << 12


def rows_per_program(t: torch.Tensor, row_elems: int, num_rows: int) -> int:
    """A power-of-two row count per program that fits the tile budget (at least 1)."""
    rows = max(1, tile_budget(t) // next_pow2(row_elems))  # both powers of two, so is the quotient
    return min(rows, next_pow2(num_rows))


def num_warps_for(block_elems: int) -> int:
    """Warps (a power of two, 1 to 8) for an element-wise/reduction tile of ``block_elems`` elements."""
    warps = min(max(int(block_elems) // 512, 1), 8)
    return 1 << (warps.bit_length() - 1)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a nominal 1 elsewhere)."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def to_e4m3(x, SOFTWARE_ROUNDING: tl.constexpr):
    """float32 ``x`` (already within +-448) as e4m3, rounded to nearest even.

    ``SOFTWARE_ROUNDING`` (set under the interpreter): round onto the e4m3 grid in float32 first, so the
    conversion itself is exact. The interpreter's conversion rounds half up and drops the carry of a
    mantissa that rounds up to the next power of two (127.9 became 64, not 128: 36 of 12288 cached keys
    in a test); GPUs convert with ``cvt.rn.satfinite``, which rounds correctly on its own.
    """
    if SOFTWARE_ROUNDING:
        bits = x.to(tl.int32, bitcast=True)
        exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3 subnormals share the step of 2^-6
        step = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3): 3 mantissa bits
        x = ((x / step + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: float32 addition rounds to even
    return x.to(tl.float8e4nv)


def fp8_native(device: torch.device) -> bool:
    """Whether Triton's FP8 type (e4m3) works on ``device``: under the interpreter, and on CUDA GPUs of
    compute capability 8.9 or later (Ada, Hopper and newer). Elsewhere FP8 data takes the reference path."""
    return device.type != "cuda" or capability(device) >= (8, 9)


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, asked of the driver once per device (it sits on per-call paths)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension has unit stride, else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()
