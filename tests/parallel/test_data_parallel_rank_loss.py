"""A data-parallel attention rank killed mid-stream: the other rank's engine, stepping in lockstep with it, notices at
its next collective (gloo sees the dead peer's connection reset; no collective timeout is waited out) and exits with
a message naming the lost rank, so the coordinator sees the group gone, as under tensor parallelism; the killed
engine's own worker ranks exit too."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import pytest

from megatron_serve import SamplingParams
from megatron_serve.engine.group.placement import RENDEZVOUS_TIMEOUT_S
from megatron_serve.model.tiny import make_tiny_model

from ..helpers import Children, alive, free_port, rank_processes
from ..model.test_moe import VARIANTS

#: What a surviving engine says when its group lost a rank (megatron_serve.errors.EngineGroupLost's messages)
LOST = re.compile(r"data-parallel attention ranks lost one of them|engine group lost a rank")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("killed, tensor", [(0, 1), (0, 2)], ids=["rank-0", "rank-0-of-tp-2"])
async def test_a_killed_data_parallel_rank_makes_the_other_exit_promptly(tmp_path, killed, tensor):
    """``killed``: which data-parallel rank's engine is SIGKILLed (rank 0 also hosts the rendezvous store: its loss
    ends the group); ``tensor``: each rank's tensor-parallel width (at 2 the killed engine's own worker rank is left
    behind). Rank 1's loss at tensor-parallel 1 leaves rank 0 serving on alone instead (test_expert_group_of_two)."""
    from megatron_serve.client.coordinator_client import InferenceClient

    model_dir = str(make_tiny_model(tmp_path / "m", seed=1, num_heads=4, num_kv_heads=2, **VARIANTS["qwen3_moe"]))
    children = Children(tmp_path)
    port = free_port()
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    try:
        children.coordinator(model_dir, port)
        engines = [children.engine(model_dir, port, "--dtype", "float32", "--data-parallel-size", "2",
                                   "--data-parallel-rank", str(rank), "--enable-expert-parallel", "--tensor-parallel-size",
                                   str(tensor), env=rendezvous)
                   for rank in range(2)]
        client = InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret)
        await client.start(timeout=60)
        await client.wait_for_engines(2, timeout=300)
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=400, ignore_eos=True)
        streaming = asyncio.Event()

        async def consume(prompt: str) -> None:
            try:
                async for _ in client.add_request_streaming(prompt, params):
                    streaming.set()
            except Exception:  # noqa: BLE001 - the streams need not survive the group's loss
                pass

        streams = [asyncio.create_task(consume(f"Request {i}: the quick brown fox")) for i in range(4)]
        await asyncio.wait_for(streaming.wait(), 300)
        assert all(e.poll() is None for e in engines)
        orphans = rank_processes(engines[killed].pid)
        assert len(orphans) == tensor - 1
        killed_at = time.monotonic()
        engines[killed].send_signal(signal.SIGKILL)
        survivor = engines[1 - killed]
        deadline = killed_at + 60  # far below the collective timeout the survivor would otherwise wait out
        assert deadline - killed_at < RENDEZVOUS_TIMEOUT_S
        while survivor.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert survivor.poll() is not None, "the surviving data-parallel rank still runs a minute after the kill"
        while any(alive(pid) for pid in orphans) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not any(alive(pid) for pid in orphans), "the killed engine's own worker ranks outlive it"
        print(f"survivor exited {time.monotonic() - killed_at:.2f} s after the kill")
        assert survivor.returncode != 0
        # the lockstep all-reduce or a forward's all-to-all, whichever ran into the dead peer first
        assert LOST.search(children.log_of(survivor)), children.log_of(survivor)[-2000:]
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        client.close()
    finally:
        children.kill_all()
