"""A steady load of streamed greedy requests through the project's coordinator client, for the day-2 scenarios on the
real cluster: what each stream saw (failed, truncated, repeated, different from an uninterrupted run, the longest gap
between two of its tokens).

Every wait is bounded: a stream with no final answer within :data:`STREAM_DEADLINE` seconds counts as failed (with
how many tokens it had), and :meth:`Load.run_until` fails past its timeout, naming what it waited for and the state
its ``context`` describes, instead of streaming on for as long as the suite lets it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.wire.request import RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams

STREAMS = 32
TOKENS = 24
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=TOKENS, ignore_eos=True)
#: Seconds one stream may take in all: a drained engine's requests wait at the coordinator for a replacement, which
#: on a loaded 2-core host starts in up to half a minute; a stream past this is lost, not slow.
STREAM_DEADLINE = 180.0


@dataclass
class Load:
    """``STREAMS`` streams, one after another per slot, until stopped: what each saw."""

    client: InferenceClient
    expected: dict[int, list[int]]
    failed: list[str] = field(default_factory=list)
    truncated: int = 0
    repeated: int = 0
    different: int = 0
    finished: int = 0
    worst_gap: float = 0.0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _one(self, slot: int, prompt: list[int]) -> None:
        streamed: list[int] = []
        gaps: list[float] = []
        last = time.monotonic()
        final: Any = None
        try:
            async with asyncio.timeout(STREAM_DEADLINE):
                async for item in self.client.add_request_streaming(prompt, PARAMS):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    if hasattr(item, "new_tokens"):
                        streamed.extend(item.new_tokens)
                    else:
                        final = item  # the last item: the loop ends by itself (leaving it early would abort)
        except TimeoutError:
            self.failed.append(f"slot {slot}: no final answer within {STREAM_DEADLINE:g}s ({len(streamed)} of "
                               f"{TOKENS} tokens streamed)")
            return
        except Exception as exc:  # noqa: BLE001 - counted, with its message
            self.failed.append(f"slot {slot}: {type(exc).__name__}: {exc}")
            return
        if final is None:
            self.failed.append(f"slot {slot}: the stream ended without a final request")
            return
        if final.status is not RequestStatus.COMPLETED:
            self.failed.append(f"slot {slot}: {final.status}: {final.error}")
            return
        self.finished += 1
        self.worst_gap = max(self.worst_gap, max(gaps, default=0.0))
        tokens = list(final.generated_tokens)
        self.truncated += len(tokens) < TOKENS
        self.repeated += streamed != tokens  # a stream that saw tokens twice (or missed some)
        self.expected.setdefault(slot, tokens)
        self.different += tokens != self.expected[slot]

    async def _slot(self, slot: int) -> None:
        prompt = [1 + slot, 7, 11, 13]
        while not self.stop.is_set():
            await self._one(slot, prompt)

    async def run_until(self, done: Callable[[], Any], timeout: float = 300.0, what: str = "the scenario's end", *,
                        check: Callable[[], None] = lambda: None, context: Callable[[], str] = lambda: "") -> None:
        """Run the streams until ``done()`` (polled in a thread) is true; again after that adds to the counts.

        ``check()`` is called at each poll and may raise (a kubelet stand-in that failed); past ``timeout`` seconds
        the streams stop and this fails naming ``what`` and ``context()``."""
        self.stop = asyncio.Event()
        slots = [asyncio.create_task(self._slot(i)) for i in range(STREAMS)]
        deadline = time.monotonic() + timeout
        try:
            while not await asyncio.to_thread(done):
                check()
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out after {timeout:g}s waiting for {what} under load ("
                                         f"{self.finished} streams finished, {len(self.failed)} failed "
                                         f"{self.failed[:2]}); {context()}")
                await asyncio.sleep(0.5)
        finally:
            self.stop.set()
            await asyncio.gather(*slots)  # each ends within STREAM_DEADLINE

    def line(self, label: str, took: float) -> str:
        return (f"{label}: {took:.0f}s, {self.finished} streams finished, {len(self.failed)} failed, {self.truncated} "
                f"truncated, {self.repeated} repeated, {self.different} differ from an uninterrupted run; longest gap "
                f"{self.worst_gap:.1f}s")


async def uninterrupted(client: InferenceClient, timeout: float, *, check: Callable[[], None] = lambda: None,
                        context: Callable[[], str] = lambda: "") -> dict[int, list[int]]:
    """The uninterrupted run a scenario's loads are compared with: each slot's answer, then the same answer again;
    returns each slot's answer (the loads' ``expected``). ``check``, ``context``: as :meth:`Load.run_until`'s."""
    expected: dict[int, list[int]] = {}
    warm = Load(client, expected)
    await warm.run_until(lambda: len(expected) == STREAMS and warm.finished >= 2 * STREAMS, timeout,
                         f"{2 * STREAMS} streams of the uninterrupted run, each slot's among them", check=check,
                         context=context)
    assert warm.failed == [] and warm.finished > 0, warm.failed[:3]
    return expected
