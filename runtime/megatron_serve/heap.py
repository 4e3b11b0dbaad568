"""Keeping a serving process's start-up heap out of the garbage collector's way.

A full collection walks every tracked object, and once torch and transformers are imported and a
tokenizer or a model is loaded a process holds hundreds of thousands of them: each full collection
stalls the whole process, every few seconds under load (the figures: docs/design-measurements.md).
Frozen, collections walk only what was created since (vLLM's servers and engines take the same
step). For processes, not libraries: the freeze is global.
"""

from __future__ import annotations

import atexit
import gc

#: Net allocations of tracked objects between two collections of the youngest generation in an HTTP server.
#: A step's frame of 64 deltas decodes to some 350 lists and structs alive at once, and each request holds a
#: few hundred objects for its lifetime: at Python's 700 the server collected after nearly every frame, and
#: moved every request's objects through the middle generation (whose collections walk them all again). Above
#: the young objects' peak, a serving level collects nothing, and what cycles leave is collected once they add up
#: to the threshold (``benchmarks/serving.py``'s counts: docs/design-measurements.md).
YOUNG_THRESHOLD = 20_000


def freeze_startup_heap() -> None:
    """Exempt everything alive now from garbage collection (call again after a late load: what was
    created since is frozen too). The heap is thawed at exit: frozen objects are never finalized, and
    Triton's nanobind extension then prints a leak report as the interpreter ends."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many calls
    atexit.register(gc.unfreeze)


def defer_young_collections(threshold: int = YOUNG_THRESHOLD) -> None:
    """Collect the youngest generation after ``threshold`` net allocations of tracked objects instead of
    Python's 700 (the older generations' ratios unchanged): for a process whose objects die young, but many
    at once, as an HTTP server's (see :data:`YOUNG_THRESHOLD`)."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(threshold, middle, old)
