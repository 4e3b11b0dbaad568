"""A whole workload given at once to an engine in this process, timed: the offline figure a benchmark sets beside
the served one. It imports nothing of the runtime, so that a script's client side can import it without the
engine's start-up cost."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_serve import DynamicInferenceRequest
    from megatron_serve.engine import DynamicInferenceEngine


def run_to_end(engine: DynamicInferenceEngine, requests: Sequence[DynamicInferenceRequest]) -> tuple[float, float]:
    """Add every request, then step the engine until none is unfinished: the wall seconds and this process's CPU
    seconds that took."""
    started, cpu_started = time.perf_counter(), time.process_time()
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started, time.process_time() - cpu_started
