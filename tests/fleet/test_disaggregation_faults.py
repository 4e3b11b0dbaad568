"""``megatron-serve run --prefill-engines 1 --decode-engines 2``: a decode engine killed (SIGKILL) mid-handoff
loses no request.

Both decode engines are stopped (SIGSTOP) before the streams start: every request is prefilled, streams its
first token and is handed to a decode engine that cannot take it yet, its blocks in flight. Then one decode
engine is killed and the other woken: the killed one's requests go to the other with the same blocks (none is
prefilled again), and every stream ends with the token ids the quiet fleet gave.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal

import httpx
import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.wire.sampling_params import SamplingParams
from tests.helpers import until
from tests.run_stack import client_stream, start_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [f"Handoff {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(8)]
TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=TOKENS, ignore_eos=True)


async def received(url: str, groups: set[int]) -> float:
    """Requests the decode engines of ``groups`` continued from transferred blocks (``/metrics``)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        metrics = (await http.get("/metrics")).text
    found = re.findall(r'^megatron_serve_kv_transfers_total\{(?=[^}]*direction="received")[^}]*engine_group="(\d+)"'
                       r'[^}]*\} (\S+)$', metrics, re.M)
    return sum(float(value) for group, value in found if int(group) in groups)


async def _at_least(url: str, groups: set[int], count: float) -> bool:
    return await received(url, groups) >= count


async def test_a_decode_engine_killed_mid_handoff_loses_no_request(tiny_llama, tmp_path):
    stack = start_run(tiny_llama, tmp_path / "run", "--prefill-engines", "1", "--decode-engines", "2",
                      "--batch-invariant", engines=3)
    try:
        async with InferenceClient(stack.coordinator(), stack.secret()) as client:
            quiet = [r.generated_tokens for r in await asyncio.gather(*(client.add_request(p, GREEDY)
                                                                        for p in PROMPTS))]
        async with InferenceClient(stack.coordinator(), stack.secret(), role="control") as control:
            engines = (await control.status())["engines"]
        decodes = [(e["info"]["pid"], e["group"]) for e in engines if e["info"].get("kv_role") == "kv_consumer"]
        assert len(decodes) == 2 and {pid for pid, _ in decodes} <= set(stack.children()["engine"]), engines
        shown = stack.control("status")
        assert (shown.count("tp1 prefill"), shown.count("tp1 decode")) == (1, 2), shown
        groups = {group for _, group in decodes}
        # the quiet pass: every request continued from its blocks (the heartbeats say so within a second)
        await until(lambda: _at_least(stack.url, groups, len(PROMPTS)), 60, "the quiet pass's transfers",
                    interval=0.2)
        assert await received(stack.url, groups) == len(PROMPTS)
        (victim, _), (survivor, survivor_group) = decodes
        before = await received(stack.url, {survivor_group})

        for pid in (victim, survivor):
            os.kill(pid, signal.SIGSTOP)
        try:
            async with InferenceClient(stack.coordinator(), stack.secret()) as client:
                firsts = [asyncio.Event() for _ in PROMPTS]
                tasks = [asyncio.create_task(client_stream(client, p, TOKENS, first))
                         for p, first in zip(PROMPTS, firsts)]
                await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)  # prefilled, handed on
                async with InferenceClient(stack.coordinator(), stack.secret(), role="control") as control:
                    assigned = {e["info"]["pid"]: e["assigned"] for e in (await control.status())["engines"]}
                assert assigned[victim] >= 1 and assigned[victim] + assigned[survivor] == len(PROMPTS), assigned
                os.kill(victim, signal.SIGKILL)
                os.kill(survivor, signal.SIGCONT)
                outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        finally:
            os.kill(survivor, signal.SIGCONT)
        for prompt, outcome, expected in zip(PROMPTS, outcomes, quiet):
            assert outcome.completed, (prompt, outcome.error)
            assert outcome.tokens == outcome.final.generated_tokens == expected, prompt
        # Not one request computed its prompt again: each continued from the blocks its prefill sent, on the
        # survivor (the killed engine received none: it was stopped until it died; its replacement loads the model
        # for longer than the survivor takes to be given every request again).
        await until(lambda: _at_least(stack.url, {survivor_group}, before + len(PROMPTS)), 60,
                    "every request's blocks received by a live decode engine", interval=0.2)
    finally:
        stack.kill()
