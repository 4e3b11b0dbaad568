"""``megatron-serve run --data-parallel-size 3 --enable-expert-parallel`` on CPU: an elastic expert group
(``InferenceConfig.elastic_expert_group``). A rank's engine SIGKILLed with streams in flight: the other two serve
on in their processes (no gang restart), ``run`` restarts the lost rank alone, it joins the running group, and every
stream ends with the tokens of an uninterrupted run (``--batch-invariant``: a token's result depends neither on the
rank count nor on where its experts run); ``control scale-ep --size 2`` mid-stream then takes the highest rank out,
which exits 0 and is not restarted, and ``control scale-ep --size 3`` brings it back: ``run`` reads the size wanted in
the coordinator's STATUS, starts the rank again, it joins, ``control status`` says 3 of 3, and the three serve.

Both tests (a lost rank 1, a lost rank 0) run on one stack, which each leaves as it found it (3 of 3 ranks serving):
a stack's start (the run loading its tokenizer, the coordinator, the rendezvous store and three engines importing
torch) was half of a test's CPU. What a test waits for in the run's and engines' output is what it adds there
(:func:`said`), not what the test before it left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from megatron_serve.model.tiny import make_tiny_model
from tests.run_stack import Outcome, RunStack, complete, start_run, stream

from .test_data_parallel_gang_run import data_parallel_rank

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [f"Elastic {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(6)]
TOKENS = 20


async def until(holds: Callable[[], bool], stack: RunStack, logs: Path, timeout: float = 60) -> None:
    """Poll ``holds`` until it does, failing past ``timeout`` with the run's output and each engine log's end (the
    run's own output is mostly its stats lines: a rank that never joined says why in its log)."""
    deadline = time.monotonic() + timeout
    while not holds():
        if time.monotonic() >= deadline:
            ends = "".join(f"\n--- {log.name}:\n{log.read_text(errors='replace')[-1500:]}"
                           for log in sorted(logs.glob("engine-*.log")))
            raise AssertionError(f"{stack.output()[-2000:]}{ends}")
        await asyncio.sleep(0.1)


def completed_by_engine(stack: RunStack) -> dict[str, int]:
    """How many requests each engine completed, from ``control status --json``."""
    return {engine["id"]: engine["completed"] for engine in json.loads(stack.control("status", "--json"))["engines"]}


JOINED = "expert-parallel rank {killed} is rank {killed} of 3"
ALONE = "alone: it joins the ranks that serve on"
LEFT = "rank 2) exited normally (exit code 0): it is not restarted"
BACK = "rank 2): group 0 is wanted at 3 ranks: starting it again"


def said(stack: RunStack, logs: Path, text: str) -> int:
    """How many times the run's output and its engines' logs say ``text``."""
    return (stack.output() + "".join(log.read_text(errors="replace") for log in logs.glob("engine-*.log"))).count(text)


@pytest.fixture(scope="module")
def elastic(tmp_path_factory) -> Iterator[tuple[RunStack, Path, list[Outcome]]]:
    """The run (3 ranks, experts over 3 then 2), its engines' log directory and each prompt's uninterrupted answer."""
    root = tmp_path_factory.mktemp("elastic")
    model = str(make_tiny_model(root / "model", seed=1, arch="qwen3_moe", num_heads=4, num_kv_heads=2,
                                num_experts=6, num_experts_per_tok=2))
    logs = root / "logs"
    stack = start_run(model, root / "run", "--data-parallel-size", "3", "--enable-expert-parallel",
                      "--batch-invariant", "--log-dir", str(logs), engines=1)

    async def quiet() -> list[Outcome]:
        await stack.wait_engines(3, timeout=300)
        async with httpx.AsyncClient(base_url=stack.url, timeout=600) as http:
            return await asyncio.gather(*(complete(http, stack.model, p, TOKENS) for p in PROMPTS))

    try:
        yield stack, logs, asyncio.run(quiet())
    finally:
        stack.kill()


@pytest.mark.parametrize("killed", [1, 0], ids=["rank-1", "rank-0"])  # rank 0: the store is a process of its own
async def test_a_lost_rank_restarts_alone_and_joins_and_scale_ep_takes_one_out_and_back(elastic, killed):
    stack, logs, quiet = elastic
    joined = JOINED.format(killed=killed)
    seen = {text: said(stack, logs, text) for text in (joined, ALONE, LEFT, BACK)}
    ranks = {data_parallel_rank(pid): pid for pid in stack.children()["engine"]}
    async with httpx.AsyncClient(base_url=stack.url, timeout=600) as http:
        streaming = asyncio.Event()
        tasks = [asyncio.create_task(stream(http, stack.model, p, TOKENS, streaming)) for p in PROMPTS]
        await asyncio.wait_for(streaming.wait(), 300)
        os.kill(ranks[killed], signal.SIGKILL)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        assert [o.tokens for o in outcomes] == [q.tokens for q in quiet], [o.error for o in outcomes]
        await until(lambda: said(stack, logs, joined) > seen[joined], stack, logs, 120)
        await stack.wait_engines(3, timeout=120)
        again = {data_parallel_rank(pid): pid for pid in stack.children()["engine"]}
        left = [r for r in range(3) if r != killed]
        assert {r: again[r] for r in left} == {r: ranks[r] for r in left}  # they served on: no gang restart
        assert again[killed] != ranks[killed] and said(stack, logs, ALONE) > seen[ALONE]
        after = await asyncio.gather(*(complete(http, stack.model, p, TOKENS) for p in PROMPTS))
        assert [a.tokens for a in after] == [q.tokens for q in quiet]

        streaming = asyncio.Event()
        tasks = [asyncio.create_task(stream(http, stack.model, p, TOKENS, streaming)) for p in PROMPTS]
        await asyncio.wait_for(streaming.wait(), 300)
        assert "scale_ep" in await asyncio.to_thread(stack.control, "scale-ep", "--size", "2")
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        assert [o.tokens for o in outcomes] == [q.tokens for q in quiet], [o.error for o in outcomes]
        await until(lambda: said(stack, logs, LEFT) > seen[LEFT], stack, logs)
        await stack.wait_engines(2, timeout=60)
        assert again[2] not in stack.children()["engine"]
        assert "expert-parallel group 0: 2 of 2 wanted ranks connected (0, 1;" in stack.control("status")
        smaller = await asyncio.gather(*(complete(http, stack.model, p, TOKENS) for p in PROMPTS))
        assert [s.tokens for s in smaller] == [q.tokens for q in quiet]

        assert "scale_ep" in stack.control("scale-ep", "--size", "3")  # run starts rank 2 again: it joins
        await until(lambda: said(stack, logs, BACK) > seen[BACK], stack, logs)
        await stack.wait_engines(3, timeout=120)
        assert {r: p for r, p in ((data_parallel_rank(p), p) for p in stack.children()["engine"]) if r < 2} == \
            {r: again[r] for r in (0, 1)}  # the two served on
        assert "expert-parallel group 0: 3 of 3 wanted ranks connected (0, 1, 2;" in stack.control("status")
        before = completed_by_engine(stack)
        larger = await asyncio.gather(*(complete(http, stack.model, p, TOKENS) for p in PROMPTS))
        assert [x.tokens for x in larger] == [q.tokens for q in quiet]
        served = {engine: done - before.get(engine, 0) for engine, done in completed_by_engine(stack).items()}
        assert len(served) == 3 and all(served.values()), served  # the joiner among them
