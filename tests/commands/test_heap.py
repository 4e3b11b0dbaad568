"""The serving processes' garbage collector settings (megatron_serve.heap)."""

import gc

from megatron_serve.heap import YOUNG_THRESHOLD, defer_young_collections


def test_defer_young_collections_sets_only_the_youngest_threshold():
    before = gc.get_threshold()
    try:
        defer_young_collections()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
        defer_young_collections(1234)
        assert gc.get_threshold() == (1234, *before[1:])
    finally:
        gc.set_threshold(*before)
