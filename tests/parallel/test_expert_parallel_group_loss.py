"""An expert-parallel group (``run --tensor-parallel 2 --enable-expert-parallel``, one group) loses a rank with
streams in flight: the next collective fails on rank 0, the group exits, ``run`` starts it again, and the
coordinator resubmits its requests; every stream ends with the text of an uninterrupted run. ``control
status`` shows the group's layout and the weights one rank holds: rank 0's share, as its HELLO says."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest
import torch

from megatron_serve.commands.control import _bytes
from megatron_serve.engine.sizing import parameter_bytes
from megatron_serve.model.config import ModelConfig
from megatron_serve.model.loader import build_model
from megatron_serve.model.parallel import TensorParallel
from megatron_serve.model.tiny import make_tiny_model
from tests.helpers import rank_processes, until
from tests.run_stack import child_pids, complete, restart_lines, start_run, stream


pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [f"Expert parallel {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(12)]
TOKENS = 64


def rank_share(model_dir: str) -> int:
    """The bytes rank 0 of 2 holds under expert parallelism: half of attention and dense layers (tensor-parallel),
    8 of the 16 experts of each MoE layer whole; well under the whole model's."""
    config = ModelConfig.from_dir(model_dir)
    share = parameter_bytes(build_model(config, torch.float32, "meta", TensorParallel(0, 2, expert_parallel=True)))
    whole = parameter_bytes(build_model(config, torch.float32, "meta"))
    assert share < 0.6 * whole
    return share


async def test_a_killed_rank_restarts_its_group_and_every_stream_completes(tmp_path):
    model = str(make_tiny_model(tmp_path / "model", seed=1, arch="qwen3_moe", num_heads=4, num_kv_heads=2,
                                num_experts=16, num_experts_per_tok=4))
    stack = start_run(model, tmp_path / "run", "--tensor-parallel", "2", "--enable-expert-parallel", engines=1)
    try:
        status = stack.control("status")
        share = rank_share(model)
        assert "tp2 ep2" in status and _bytes(share) in status, status  # the layout, and one rank's weights
        [engine_status] = json.loads(stack.control("status", "--json"))["engines"]
        assert engine_status["info"]["parameter_bytes"] == share  # from the engine's HELLO
        async with httpx.AsyncClient(base_url=stack.url, timeout=600) as http:
            quiet = await asyncio.gather(*(complete(http, stack.model, p, TOKENS) for p in PROMPTS))
            firsts = [asyncio.Event() for _ in PROMPTS]
            tasks = [asyncio.create_task(stream(http, stack.model, p, TOKENS, first))
                     for p, first in zip(PROMPTS, firsts)]
            waits = [asyncio.create_task(first.wait()) for first in firsts]
            await asyncio.wait(waits, timeout=300, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
            # Rank 0 held still from the first token to the kill: the streams cannot run out in between (a loaded
            # machine once let all 64 tokens of every stream through before the kill, which then tested nothing).
            engine = stack.one("engine")
            os.kill(engine, signal.SIGSTOP)
            try:
                [follower] = rank_processes(engine)
                # forked by the engine itself, whose lifeline thread holds no lock: no fork server importing torch
                # again (2 s of CPU a group start) beside it
                assert follower in child_pids(engine), f"rank {follower} is not the engine's own child"
                assert not any(task.done() for task in tasks), "the streams ended before the kill: nothing is tested"
                os.kill(follower, signal.SIGKILL)
            finally:
                os.kill(engine, signal.SIGCONT)
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 600)
        for prompt, expected, outcome in zip(PROMPTS, quiet, outcomes):
            assert outcome.completed and outcome.finish_reason == "length", (prompt, outcome)
            assert (outcome.text, outcome.tokens) == (expected.text, expected.tokens), prompt
        assert restart_lines(stack.output(), "engine"), "the group did not die and restart"
        await until(lambda: engine not in stack.children()["engine"], 60, "the broken group's process to go")
        await stack.wait_engines(1, timeout=300)
    finally:
        stack.kill()
