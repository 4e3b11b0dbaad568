"""Recording which Triton kernel variants a piece of code launches (the Triton interpreter on CPU).

A GPU compiles one binary per variant: the kernel, its constexpr values, its launch options, the value
class (1, a multiple of 16, other) of each integer argument it specializes on and whether each tensor's
address is a multiple of 16 bytes (a slice that starts at an odd row of a small-element tensor is not).
The interpreter compiles nothing, so on CPU the same key is recorded at every launch instead: a variant
first seen after the engine's start-up sweep is one a GPU would have compiled mid-serving.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def _int_class(value: int) -> str:
    return "1" if value == 1 else "16n" if value % 16 == 0 else "int"


def variant_key(kernel: InterpretedFunction, args: tuple, kwargs: dict[str, Any]) -> tuple:
    params = list(inspect.signature(kernel.fn).parameters.values())
    bound = dict(zip((p.name for p in params), args)) | {k: v for k, v in kwargs.items()}
    unspecialized = set(kernel.kwargs.get("do_not_specialize") or ())
    any_alignment = unspecialized | set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    parts = []
    for param in params:
        value = bound.get(param.name)
        if param.annotation is tl.constexpr or "constexpr" in str(param.annotation):
            parts.append((param.name, value))
        elif isinstance(value, torch.Tensor):
            aligned = "any" if param.name in any_alignment else value.data_ptr() % 16 == 0
            parts.append((param.name, str(value.dtype), aligned))
        elif isinstance(value, int) and not isinstance(value, bool) and param.name not in unspecialized:
            parts.append((param.name, _int_class(value)))
    options = tuple((name, kwargs[name]) for name in ("num_warps", "num_stages") if name in kwargs)
    return (kernel.__name__, tuple(parts), options)


@contextlib.contextmanager
def recorded_variants() -> Iterator[set[tuple]]:
    """Every kernel variant launched inside the block (interpreted launches only)."""
    seen: set[tuple] = set()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        seen.add(variant_key(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield seen
    finally:
        InterpretedFunction.run = run
