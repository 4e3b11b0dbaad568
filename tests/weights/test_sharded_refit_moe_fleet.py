"""A sharded trainer of world size 4 with its MoE experts split by rank (expert parallel) refits a fleet of a
tensor-parallel 1 and a tensor-parallel 2 group (issue 50's acceptance), gloo on CPU, every rank its own process.

Each trainer rank holds the experts ``e`` with ``e % 4 == rank`` whole and a quarter of every dense weight; every
engine rank receives from all four ranks at once, exactly its slices. Afterwards greedy outputs equal a server of
the new checkpoint, token for token.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.model.tiny import make_tiny_model

from ..helpers import Children, free_port
from .test_sharded_refit_fleet import assert_serves, outputs, run_trainers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded-refit-moe")
    a, b = (str(make_tiny_model(root / name, seed=seed, arch="qwen3_moe")) for name, seed in (("a", 0), ("b", 1)))
    expected = SimpleNamespace(a=outputs(a), b=outputs(b))
    assert expected.a != expected.b
    return SimpleNamespace(a=a, b=b, expected=expected, state=load_file(str(Path(b) / "model.safetensors")))


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    children = Children(tmp_path_factory.mktemp("sharded-refit-moe-logs"))
    port = free_port()
    children.coordinator(models.a, port)
    children.engine(models.a, port, "--group", "0")
    children.engine(models.a, port, "--group", "1", "--tensor-parallel", "2")
    try:
        yield SimpleNamespace(address=f"tcp://127.0.0.1:{port}", children=children)
    finally:
        children.kill_all()


async def test_four_trainer_ranks_with_experts_split_by_rank_refit_the_fleet(fleet, models):
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await client.wait_for_engines(2, timeout=300)
        await assert_serves(client, models.expected.a, 0)
        await client.pause()
        results = await asyncio.to_thread(run_trainers, fleet, models.b, 2, 4)
        assert [code for code, _ in results] == [0] * 4, results
        senders = [lines[-1]["detail"]["sender"] for _, lines in results]
        held = [lines[0]["holds"] for _, lines in results]
        total = sum(t.numel() * t.element_size() for t in models.state.values())
        experts = sum(t.numel() * t.element_size() for n, t in models.state.items() if ".experts." in n)
        assert experts > total / 2 and all(s["world_size"] == 7 for s in senders)  # 4 trainer + 3 engine ranks
        for rank, sender in enumerate(senders):  # engine rank 4 serves everything: exactly what this rank holds
            assert sender["links"]["4"] == held[rank] and held[rank] < 0.4 * total
        receivers = {int(r): f for r, f in results[0][1][-1]["detail"]["receivers"].items()}
        assert receivers[4]["bytes"] == total
        for rank in (5, 6):  # half of every expert and dense weight, from all four trainer ranks
            assert receivers[rank]["bytes"] == receivers[rank]["serves_bytes"] < 0.55 * total
            assert all(s["links"].get(str(rank), 0) > 0 for s in senders)
        await client.unpause()
        await assert_serves(client, models.expected.b, 2)
