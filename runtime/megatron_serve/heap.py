"""Keeping a serving process's start-up heap out of the garbage collector's way, and a CPU engine's step buffers
in the C heap.

A full collection walks every tracked object, and once torch and transformers are imported and a
tokenizer or a model is loaded a process holds hundreds of thousands of them: each full collection
stalls the whole process, every few seconds under load (the figures: docs/design-measurements.md).
Frozen, collections walk only what was created since (vLLM's servers and engines take the same
step). For processes, not libraries: the freeze is global.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import sys

#: Net allocations of tracked objects between two collections of the youngest generation in an HTTP server.
#: A step's frame of 64 deltas decodes to some 350 lists and structs alive at once, and each request holds a
#: few hundred objects for its lifetime: at Python's 700 the server collected after nearly every frame, and
#: moved every request's objects through the middle generation (whose collections walk them all again). Above
#: the young objects' peak, a serving level collects nothing, and what cycles leave is collected once they add up
#: to the threshold (``benchmarks/serving.py``'s counts: docs/design-measurements.md).
YOUNG_THRESHOLD = 20_000


def pause_collection_until_started() -> None:
    """No collection while a serving process starts, until :func:`freeze_startup_heap`: what start-up creates
    (modules, a model, a tokenizer) is what the process keeps, and each time it outgrew the oldest generation the
    collector walked all of it again, for nothing; in importing torch alone, about a tenth of the CPU."""
    gc.disable()


def freeze_startup_heap() -> None:
    """Exempt everything alive now from garbage collection (call again after a late load: what was
    created since is frozen too), and collect from now on (:func:`pause_collection_until_started`). The heap is
    thawed at exit only in a process that loaded Triton: frozen objects are never finalized, and Triton's nanobind
    extension then prints a leak report as the interpreter ends. Elsewhere it stays frozen, so the interpreter's
    last collection skips it: thawed, that walk of the start-up heap took `megatron-serve run` 2-3 of the 5 seconds
    it spent stopping when idle."""
    gc.collect()
    gc.freeze()
    gc.enable()
    atexit.unregister(_thaw_for_triton)  # once, however many calls
    atexit.register(_thaw_for_triton)


def _thaw_for_triton() -> None:
    if "triton" in sys.modules:
        gc.unfreeze()


def defer_young_collections(threshold: int = YOUNG_THRESHOLD) -> None:
    """Collect the youngest generation after ``threshold`` net allocations of tracked objects instead of
    Python's 700 (the older generations' ratios unchanged): for a process whose objects die young, but many
    at once, as an HTTP server's (see :data:`YOUNG_THRESHOLD`)."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(threshold, middle, old)


#: glibc's ``mallopt`` parameter numbers (``malloc.h``).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Requests from this size on get a mapping of their own, unmapped when freed: 32 MiB, the largest glibc accepts.
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap that stays there for the next step rather than going back to the system.
TRIM_THRESHOLD = 128 << 20


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep what a step frees for the next step; False where the C library is not glibc.

    By default glibc serves a request above its mapping threshold (128 KiB at start, raised only to the largest
    mapping freed so far) with a fresh mapping, and hands the top of the heap back to the system once more than
    twice that is free. A step of an engine on a CPU allocates and frees its activations and gathered keys and
    values, several MiB each, in every layer: they came back as fresh pages step after step, each one zeroed by
    the kernel at its first touch (the counts: docs/design-measurements.md). Fixed thresholds keep them in the
    heap. Process-wide, as every allocator setting is: for processes that run an engine on a CPU.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt, _ = libc.mallopt, libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
