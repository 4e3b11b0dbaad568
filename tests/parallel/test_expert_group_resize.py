"""A tiny Qwen3-MoE over expert parallelism 4 with data-parallel attention (four engine processes over gloo, one
rank each): one is SIGKILLed mid-stream and the three others serve on (test_data_parallel_rank_survival), then the
lost rank's restart joins the running group (engine.group.membership): the members take it in at a turn they agree
on, the four form the next generation's group, the experts go back to their placement by index, and every stream
after the join has the tokens of an uninterrupted run (``--batch-invariant``) with each of the four ranks serving
some of them."""

from __future__ import annotations

import asyncio
import time

import pytest

from megatron_serve.model.tiny import make_tiny_model
from tests.run_stack import client_stream

from ..helpers import Children, free_port
from ..model.test_moe import VARIANTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RANKS, KILLED = 4, 2
PROMPTS = [f"Request {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(8)]
TOKENS = 32


async def completed_by_engine(client) -> dict[str, int]:
    return {engine["id"]: engine["completed"] for engine in (await client.status())["engines"]}


def wait_for_log(children: Children, proc, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in children.log_of(proc):
        assert proc.poll() is None and time.monotonic() < deadline, children.log_of(proc)[-3000:]
        time.sleep(0.05)


async def test_the_lost_rank_restarted_joins_the_running_group_and_serves(tmp_path):
    from megatron_serve.client.coordinator_client import InferenceClient  # noqa: PLC0415

    model_dir = str(make_tiny_model(tmp_path / "m", seed=1, num_heads=4, num_kv_heads=2, **VARIANTS["qwen3_moe"]))
    children = Children(tmp_path)
    port = free_port()
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    client = None

    def engine(rank: int):
        return children.engine(model_dir, port, "--dtype", "float32", "--batch-invariant", "--data-parallel-size",
                               str(RANKS), "--data-parallel-rank", str(rank), "--enable-expert-parallel",
                               env=rendezvous)

    try:
        children.coordinator(model_dir, port)
        engines = [engine(rank) for rank in range(RANKS)]
        client = InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret)
        await client.start(timeout=60)
        await client.wait_for_engines(RANKS, timeout=300)
        quiet = await asyncio.gather(*(client_stream(client, p, TOKENS) for p in PROMPTS))
        assert all(q.completed for q in quiet), [q.error for q in quiet]
        firsts = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.create_task(client_stream(client, p, TOKENS, first)) for p, first in zip(PROMPTS, firsts)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 300)
        survivors = [engine for rank, engine in enumerate(engines) if rank != KILLED]
        pids = [engine.pid for engine in survivors]
        engines[KILLED].kill()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 600)
        assert [o.tokens for o in outcomes] == [q.tokens for q in quiet], [o.error for o in outcomes]

        joiner = engine(KILLED)  # the lost rank's restart: the same command, the same rendezvous
        wait_for_log(children, joiner, f"expert-parallel rank {KILLED} is rank {KILLED} of {RANKS}", 120)
        for rank, survivor in zip([r for r in range(RANKS) if r != KILLED], survivors):
            wait_for_log(children, survivor, f"expert-parallel rank {rank} is rank {rank} of {RANKS}", 30)
        await client.wait_for_engines(RANKS, timeout=60)
        before = await completed_by_engine(client)
        after_join = await asyncio.gather(*(client_stream(client, p, TOKENS) for p in PROMPTS))
        assert [a.tokens for a in after_join] == [q.tokens for q in quiet], [a.error for a in after_join]
        served = {engine: done - before.get(engine, 0) for engine, done in (await completed_by_engine(client)).items()}
        assert len(served) == RANKS and all(served.values()), served  # the joiner among them
        assert [engine.pid for engine in survivors if engine.poll() is None] == pids  # none restarted, none gone
    finally:
        if client is not None:
            client.close()
        children.kill_all()
