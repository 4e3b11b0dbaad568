"""The disk KV tier's Prometheus series over ``/metrics``, with a real engine in this process (direct mode).

A first pass of fourteen prompts pushes blocks out of the device pool and the host tier onto the node's disk: the
written, I/O and usage series move, nothing is read yet. The first prompt again finds its five blocks on disk: the
hits and the bytes read move by them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from megatron_serve import MegatronAsyncLLM
from megatron_serve.server import create_app

from ..engine.disk_tier_run import BLOCK, BLOCK_BYTES, config, prompts
from .conftest import serving

FAMILIES = ("kv_disk_blocks_written", "kv_disk_hits", "kv_disk_io_bytes", "kv_disk_usage_bytes", "kv_disk_blocks",
            "kv_disk_errors", "generation_tokens")


def disk_series(text: str) -> dict[tuple[str, str], float]:
    """The disk tier's samples (and the tokens generated) of one ``/metrics`` text: ``(name, operation)`` -> value."""
    return {(family.name.removeprefix("megatron_serve_"), sample.labels.get("operation", "")): sample.value
            for family in text_string_to_metric_families(text)
            if family.name.removeprefix("megatron_serve_") in FAMILIES for sample in family.samples}


async def scrape_until(http: httpx.AsyncClient, ready: Callable[[dict[tuple[str, str], float]], bool]
                       ) -> dict[tuple[str, str], float]:
    """The first :func:`disk_series` that is ``ready`` (the engine's heartbeat, and the disk writes it counts, lag the
    answers)."""
    deadline = time.monotonic() + 60
    while True:
        values = disk_series((await http.get("/metrics")).text)
        if ready(values):
            return values
        assert time.monotonic() < deadline, f"the disk tier's series never got there: {values}"
        await asyncio.sleep(0.05)


async def complete(http: httpx.AsyncClient, prompt: list[int]) -> dict:
    answer = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                       "temperature": 0, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    return answer.json()


async def test_the_disk_tier_series_move_as_blocks_go_to_disk_and_come_back(tiny_model, tokenizer, tmp_path):
    async with MegatronAsyncLLM(tiny_model, config(str(tmp_path))) as llm:
        app = create_app(llm.client, tokenizer, "tiny", status_interval=0.05)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
            batch = prompts()
            for prompt in batch:
                await complete(http, prompt)
            first = await scrape_until(http, lambda v: v.get(("generation_tokens", ""), 0) >= 4 * len(batch)
                                       and v.get(("kv_disk_blocks_written", ""), 0) >= 30)
            written = first[("kv_disk_blocks_written", "")]
            assert first[("kv_disk_hits", "")] == 0 and first[("kv_disk_io_bytes", "read")] == 0
            assert first[("kv_disk_io_bytes", "write")] >= written * BLOCK_BYTES
            assert first[("kv_disk_usage_bytes", "")] > 0 and first[("kv_disk_blocks", "")] > 0
            assert first[("kv_disk_errors", "write")] == first[("kv_disk_errors", "read")] == 0

            again = await complete(http, batch[0])
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK
            second = await scrape_until(http, lambda v: v[("kv_disk_hits", "")] >= 5)
            assert second[("kv_disk_hits", "")] == 5  # the first prompt's five blocks, read back
            assert second[("kv_disk_io_bytes", "read")] >= 5 * BLOCK_BYTES
