"""A tiny Qwen3-MoE over expert parallelism 4 with data-parallel attention (four engine processes over gloo, one
rank each): one is SIGKILLed mid-stream, and the three others serve on in their own processes: they regroup over the
ranks left, agree where each stopped and resume from one step boundary (engine.group.regroup), the lost rank's
experts (placed by index) are read back from the checkpoint onto them, the coordinator resubmits the killed engine's
requests as it does for any lost engine, and every stream completes with the tokens of an uninterrupted run
(``--batch-invariant``: a token's result depends neither on the rank count nor on where its experts run)."""

from __future__ import annotations

import asyncio

import pytest

from megatron_serve.model.tiny import make_tiny_model
from tests.run_stack import client_stream

from ..helpers import Children, free_port
from ..model.test_moe import VARIANTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RANKS, KILLED = 4, 2
PROMPTS = [f"Request {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(8)]
TOKENS = 48


async def test_a_killed_rank_leaves_the_others_serving_in_their_own_processes(tmp_path):
    from megatron_serve.client.coordinator_client import InferenceClient  # noqa: PLC0415

    model_dir = str(make_tiny_model(tmp_path / "m", seed=1, num_heads=4, num_kv_heads=2, **VARIANTS["qwen3_moe"]))
    children = Children(tmp_path)
    port = free_port()
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    client = None
    try:
        children.coordinator(model_dir, port)
        engines = [children.engine(model_dir, port, "--dtype", "float32", "--batch-invariant", "--data-parallel-size",
                                   str(RANKS), "--data-parallel-rank", str(rank), "--enable-expert-parallel",
                                   env=rendezvous)
                   for rank in range(RANKS)]
        client = InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret)
        await client.start(timeout=60)
        await client.wait_for_engines(RANKS, timeout=300)
        quiet = await asyncio.gather(*(client_stream(client, p, TOKENS) for p in PROMPTS))
        assert all(q.completed for q in quiet), [q.error for q in quiet]
        firsts = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.create_task(client_stream(client, p, TOKENS, first)) for p, first in zip(PROMPTS, firsts)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 300)
        assert not any(task.done() for task in tasks), "the streams ended before the kill: nothing is tested"
        survivors = [engine for rank, engine in enumerate(engines) if rank != KILLED]
        pids = [engine.pid for engine in survivors]
        engines[KILLED].kill()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 600)
        for prompt, expected, outcome in zip(PROMPTS, quiet, outcomes):
            assert outcome.completed, (prompt, outcome.error)
            assert outcome.tokens == expected.tokens, prompt
        assert [engine.pid for engine in survivors if engine.poll() is None] == pids  # none restarted, none gone
        for rank, engine in zip([r for r in range(RANKS) if r != KILLED], survivors):
            assert f"expert-parallel rank {rank} is rank" in children.log_of(engine), children.log_of(engine)[-3000:]
        again = await asyncio.gather(*(client_stream(client, p, TOKENS) for p in PROMPTS[:3]))
        assert [a.tokens for a in again] == [q.tokens for q in quiet[:3]]  # the three serve on
    finally:
        if client is not None:
            client.close()
        children.kill_all()
