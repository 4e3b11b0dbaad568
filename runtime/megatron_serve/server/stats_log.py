"""The periodic stats line vLLM users watch: throughput, queue, KV-cache usage, prefix-cache hit rate.

Every ``interval`` seconds (10, vLLM's) while the fleet is busy, one INFO line on the
``megatron_serve.stats`` logger, computed from the engines' cumulative counters in the
coordinator's ``STATUS_REPLY`` that the server already polls (no extra traffic). An idle fleet logs
nothing after one last line showing it went idle. ``--disable-log-stats`` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from .fleet import FleetMonitor
from .metrics import read_engine

logger = logging.getLogger("megatron_serve.stats")


@dataclass(frozen=True)
class FleetCounters:
    """The fleet's cumulative token counters at one moment (all engine groups)."""

    at: float
    prompt_tokens: float
    generation_tokens: float
    cache_queries: float
    cache_hits: float
    drafts: float = 0.0  # speculative decoding: requests verified with drafts, and draft tokens accepted
    accepted: float = 0.0
    draft_tokens: float = 0.0  # draft tokens verified, and decode rows that could speculate (mean K)
    rows: float = 0.0

    @classmethod
    def read(cls, monitor: FleetMonitor, now: float) -> "FleetCounters":
        sums = {"prompt_tokens_total": 0.0, "generation_tokens_total": 0.0, "prefix_cache_queries_total": 0.0,
                "prefix_cache_hits_total": 0.0, "spec_decode_num_drafts_total": 0.0,
                "spec_decode_num_accepted_tokens_total": 0.0, "spec_decode_num_draft_tokens_total": 0.0,
                "spec_decode_num_rows_total": 0.0}
        for engine in monitor.engines if monitor.reachable else []:
            values = read_engine(engine).values
            for name in sums:
                sums[name] += sum(values.get(name, {}).values())
        return cls(now, sums["prompt_tokens_total"], sums["generation_tokens_total"],
                   sums["prefix_cache_queries_total"], sums["prefix_cache_hits_total"],
                   sums["spec_decode_num_drafts_total"], sums["spec_decode_num_accepted_tokens_total"],
                   sums["spec_decode_num_draft_tokens_total"], sums["spec_decode_num_rows_total"])


def stats_line(before: FleetCounters, now: FleetCounters, monitor: FleetMonitor) -> tuple[str, bool]:
    """The line for the interval from ``before`` to ``now``, and whether the fleet was busy in it."""
    seconds = max(now.at - before.at, 1e-9)
    prompt = max(now.prompt_tokens - before.prompt_tokens, 0.0) / seconds
    generation = max(now.generation_tokens - before.generation_tokens, 0.0) / seconds
    queries = now.cache_queries - before.cache_queries
    hit_rate = 100.0 * (now.cache_hits - before.cache_hits) / queries if queries > 0 else 0.0
    engines = monitor.engines if monitor.reachable else []
    running = sum(int(e.get("running") or 0) for e in engines)
    totals = monitor.totals()
    waiting = sum(int(e.get("waiting") or 0) for e in engines) + totals["queued"]
    usage = 100.0 * totals["kv_blocks_used"] / totals["kv_blocks_total"] if totals["kv_blocks_total"] else 0.0
    line = (f"fleet of {len(engines)} engine group(s): avg prompt throughput {prompt:.1f} tokens/s, avg generation "
            f"throughput {generation:.1f} tokens/s, running {running} reqs, waiting {waiting} reqs, KV cache usage "
            f"{usage:.1f}%, prefix cache hit rate {hit_rate:.1f}%")
    drafts = now.drafts - before.drafts
    if drafts > 0:  # vLLM's "mean acceptance length": tokens per verified request row (accepted drafts + 1)
        line += f", speculative mean acceptance length {1.0 + (now.accepted - before.accepted) / drafts:.2f}"
    rows = now.rows - before.rows
    if rows > 0:  # draft tokens per decode row that could speculate: the adaptive policy's K (0: not drafting)
        line += f", speculative mean K {(now.draft_tokens - before.draft_tokens) / rows:.2f}"
    return line, bool(prompt or generation or running or waiting)


async def log_stats(monitor: FleetMonitor, interval: float) -> None:
    """Log :func:`stats_line` every ``interval`` seconds while busy, until cancelled."""
    logger.setLevel(logging.INFO)
    before = FleetCounters.read(monitor, time.monotonic())
    was_busy = False
    while True:
        await asyncio.sleep(interval)
        now = FleetCounters.read(monitor, time.monotonic())
        line, busy = stats_line(before, now, monitor)
        if busy or was_busy:
            logger.info("%s", line)
        before, was_busy = now, busy
