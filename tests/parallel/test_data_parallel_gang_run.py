"""``megatron-serve run --data-parallel-size 2 --tensor-parallel 2 --enable-expert-parallel``: one group of two
data-parallel attention ranks (two engine processes sharing the experts, each with a tensor-parallel worker: not an
elastic group, which restarts a lost rank alone), shown rank by rank by ``control status``. A rank's engine SIGKILLed
with streams in flight (rank 0, which also hosts the group's rendezvous): the other rank and every worker are ended,
the gang starts again on a fresh rendezvous, the coordinator resubmits the gang's requests, and every stream ends
with the text and tokens of an uninterrupted run (greedy, tiny Qwen3-MoE, float32: the checkpoint's dtype, and the
CPU default; no ``--dtype``, which would make ``run``'s server import torch to resolve it, some 2 CPU-s)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from megatron_serve.model.tiny import make_tiny_model
from tests.run_stack import command_line, complete, start_run, stream

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [f"Data parallel {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(8)]
TOKENS = 96


def data_parallel_rank(pid: int) -> int:
    argv = command_line(pid)
    return int(argv[argv.index("--data-parallel-rank") + 1])


def rendezvous(logs: Path, pid: int) -> str:
    """The engine's ``MASTER_ADDR:MASTER_PORT``, where its gang meets, as its log says (a forked engine's
    /proc/PID/environ is its launcher's)."""
    said = re.compile(rf"\(pid {pid}\): its group meets at (\S+)")
    found = [m.group(1) for log in logs.glob("engine-*.log") for m in said.finditer(log.read_text(errors="replace"))]
    assert len(found) == 1, (pid, found)
    return found[0]


async def test_a_killed_rank_restarts_its_gang_and_every_stream_completes_with_the_uninterrupted_text(tmp_path):
    model = str(make_tiny_model(tmp_path / "model", seed=1, arch="qwen3_moe", num_heads=4, num_kv_heads=2,
                                num_experts=16, num_experts_per_tok=4))
    logs = tmp_path / "logs"
    stack = start_run(model, tmp_path / "run", "--data-parallel-size", "2", "--tensor-parallel", "2",
                      "--enable-expert-parallel", "--log-dir",
                      str(logs), engines=1)
    try:
        await stack.wait_engines(2, timeout=300)
        status = stack.control("status")
        assert re.search(r"e\d+-g0-dp0 +0 .*tp2 ep4 dp0/2", status) and re.search(r"e\d+-g0-dp1 +0 .*tp2 ep4 dp1/2",
                                                                                  status), status
        ranks = {data_parallel_rank(pid): pid for pid in stack.children()["engine"]}
        assert sorted(ranks) == [0, 1] and rendezvous(logs, ranks[0]) == rendezvous(logs, ranks[1])
        met = rendezvous(logs, ranks[0])
        async with httpx.AsyncClient(base_url=stack.url, timeout=600) as http:
            quiet = await asyncio.gather(*(complete(http, stack.model, p, TOKENS) for p in PROMPTS))
            streaming = asyncio.Event()  # the first chunk of any stream: the kill lands while they all run
            tasks = [asyncio.create_task(stream(http, stack.model, p, TOKENS, streaming)) for p in PROMPTS]
            await asyncio.wait_for(streaming.wait(), 300)
            assert not any(task.done() for task in tasks), "the streams ended before the kill: nothing is tested"
            os.kill(ranks[0], signal.SIGKILL)
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 600)
        for prompt, expected, outcome in zip(PROMPTS, quiet, outcomes):
            assert outcome.completed and outcome.finish_reason == "length", (prompt, outcome)
            assert (outcome.text, outcome.tokens) == (expected.text, expected.tokens), prompt
        assert "group 0 lost engine 0 (group 0, data-parallel rank 0): killed by SIGKILL" in stack.output()
        # the control: the kill took requests in flight on the gang, which the coordinator resubmitted
        requeued = [int(n) for n in re.findall(r"engine e\d+-g0-dp\d \(group 0\) removed: .*; (\d+) request\(s\) "
                                               r"re-queued", (logs / "coordinator.log").read_text())]
        assert sum(requeued) > 0, requeued
        await stack.wait_engines(2, timeout=300)
        again = {data_parallel_rank(pid): pid for pid in stack.children()["engine"]}
        assert sorted(again) == [0, 1] and not set(again.values()) & set(ranks.values())
        assert rendezvous(logs, again[0]) == rendezvous(logs, again[1]) != met  # a fresh rendezvous for the new gang
        status = stack.control("status")
        assert "dp0/2" in status and "dp1/2" in status and "e1-g0" not in status and "e2-g0" not in status, status
    finally:
        stack.kill()
