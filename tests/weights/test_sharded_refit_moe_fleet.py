"""A sharded trainer of world size 4 with its MoE experts split by rank (expert parallel) refits a fleet of a
tensor-parallel 1, a tensor-parallel 2 and an expert-parallel 2 group (issue 50's acceptance), gloo on CPU, every
rank its own process.

Each trainer rank holds the experts ``e`` with ``e % 4 == rank`` whole and a quarter of every dense weight; every
engine rank receives from all four ranks at once, exactly its slices: a tensor-parallel rank half of every expert,
an expert-parallel rank its four experts whole and nothing of the other rank's. Afterwards greedy outputs equal a
server of the new checkpoint, token for token, on every group.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.model.tiny import make_tiny_model

from .checkpoint_cuts import EXPERT
from .test_sharded_refit_fleet import assert_serves, outputs, run_trainers, three_groups

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
    with three_groups(models.a, tmp_path_factory.mktemp("sharded-refit-moe-logs"), "--tensor-parallel", "2",
                      "--enable-expert-parallel") as groups:
        yield groups


async def test_four_trainer_ranks_with_experts_split_by_rank_refit_the_fleet(fleet, models):
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await assert_serves(client, models.expected.a, 0)
        await client.pause()
        results = await asyncio.to_thread(run_trainers, fleet, models.b, 2, 4)
        assert [code for code, _ in results] == [0] * 4, results
        senders = [lines[-1]["detail"]["sender"] for _, lines in results]
        held = [lines[0]["holds"] for _, lines in results]
        total = sum(t.numel() * t.element_size() for t in models.state.values())
        experts = {n: t.numel() * t.element_size() for n, t in models.state.items() if ".experts." in n}
        assert sum(experts.values()) > total / 2 and all(s["world_size"] == 9 for s in senders)  # 4 + 5 engine ranks
        for rank, sender in enumerate(senders):  # engine rank 4 serves everything: exactly what this rank holds
            assert sender["links"]["4"] == held[rank] and held[rank] < 0.4 * total
        receivers = {int(r): f for r, f in results[0][1][-1]["detail"]["receivers"].items()}
        assert sorted(receivers) == [4, 5, 6, 7, 8] and receivers[4]["bytes"] == total
        for rank in (5, 6):  # half of every expert and dense weight, from all four trainer ranks
            assert receivers[rank]["bytes"] == receivers[rank]["serves_bytes"] < 0.55 * total
            assert all(s["links"].get(str(rank), 0) > 0 for s in senders)
        for first, rank in ((0, 7), (4, 8)):  # its four experts whole, none of the other rank's
            own = sum(size for n, size in experts.items() if first <= int(EXPERT.search(n)[1]) < first + 4)
            dense = total - 2 * own  # attention and vocabulary halved, norms and routers whole
            assert own + dense / 2 <= receivers[rank]["bytes"] == receivers[rank]["serves_bytes"] < own + 0.6 * dense
            assert all(s["links"].get(str(rank), 0) > 0 for s in senders)  # trainer rank r: experts r and r + 4
        await client.unpause()
        await assert_serves(client, models.expected.b, 2)
