"""Resizing an expert-parallel group of data-parallel attention ranks without a restart (engine.group.membership),
over a tiny Qwen3-MoE on four engine processes over gloo, one rank each, under ``--batch-invariant`` (a token's
result depends neither on the rank count nor on where its experts run, so every stream must have the tokens of an
uninterrupted run):

* one rank SIGKILLed mid-stream, the three others serve on (test_data_parallel_rank_survival), then the lost rank's
  restart joins the running group: the members take it in at a turn they agree on, the four form the next
  generation's group, the experts go back to their placement by index, and each of the four serves;
* ``scale_ep 3`` mid-stream: the highest rank hands its requests back and exits, the three others regroup without
  it and every stream completes; its restart then joins, and the four serve again."""

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


def engines_for(children: Children, model_dir: str, port: int, rendezvous: dict[str, str]):
    def engine(rank: int):
        return children.engine(model_dir, port, "--dtype", "float32", "--batch-invariant", "--data-parallel-size",
                               str(RANKS), "--data-parallel-rank", str(rank), "--enable-expert-parallel",
                               env=rendezvous)
    return engine


async def served_by_each(client, prompts: list[str], expected) -> dict[str, int]:
    """``prompts`` streamed at once, their tokens those ``expected``; how many each engine completed meanwhile."""
    before = await completed_by_engine(client)
    streams = await asyncio.gather(*(client_stream(client, p, TOKENS) for p in prompts))
    assert [s.tokens for s in streams] == [e.tokens for e in expected], [s.error for s in streams]
    return {engine: done - before.get(engine, 0) for engine, done in (await completed_by_engine(client)).items()}


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
    engine = engines_for(children, model_dir, port, rendezvous)
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
        served = await served_by_each(client, PROMPTS, quiet)
        assert len(served) == RANKS and all(served.values()), served  # the joiner among them
        assert [engine.pid for engine in survivors if engine.poll() is None] == pids  # none restarted, none gone
    finally:
        if client is not None:
            client.close()
        children.kill_all()


async def test_scale_ep_shrinks_the_group_mid_stream_and_its_restart_joins_again(tmp_path):
    from megatron_serve.client.coordinator_client import InferenceClient  # noqa: PLC0415

    model_dir = str(make_tiny_model(tmp_path / "m", seed=1, num_heads=4, num_kv_heads=2, **VARIANTS["qwen3_moe"]))
    children = Children(tmp_path)
    port = free_port()
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    client = None
    engine = engines_for(children, model_dir, port, rendezvous)
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
        ack = await client.scale_ep(RANKS - 1)
        assert ack["detail"]["wanted"] == RANKS - 1 and len(ack["detail"]["leaving"]) == 1, ack
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 600)
        assert [o.tokens for o in outcomes] == [q.tokens for q in quiet], [o.error for o in outcomes]
        left = engines[RANKS - 1]
        assert left.wait(timeout=60) == 0, children.log_of(left)[-3000:]
        for rank in range(RANKS - 1):
            wait_for_log(children, engines[rank], f"expert-parallel rank {rank} is rank {rank} of {RANKS - 1}", 30)
        served = await served_by_each(client, PROMPTS, quiet)
        assert len(served) == RANKS - 1 and all(served.values()), served

        joiner = engine(RANKS - 1)  # scale back up: the rank's engine started again joins
        wait_for_log(children, joiner, f"expert-parallel rank {RANKS - 1} is rank {RANKS - 1} of {RANKS}", 120)
        await client.wait_for_engines(RANKS, timeout=60)
        served = await served_by_each(client, PROMPTS, quiet)
        assert len(served) == RANKS and all(served.values()), served
    finally:
        if client is not None:
            client.close()
        children.kill_all()
