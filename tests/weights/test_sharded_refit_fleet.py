"""A sharded trainer refits a fleet (issue 50's acceptance), gloo on CPU, every rank its own process.

A coordinator and two engine groups (tensor-parallel 1 and 2) serve model A; two trainer processes
(``sharded_trainer.py``, world size 2) hold B as Megatron would (column-parallel weights cut by rows, row-parallel
by columns, vocabulary by rows, norms on rank 0) and each sends its own pieces. Afterwards greedy outputs equal a
server of B, token for token; each rank's acknowledgement counts its own bytes; every engine rank received
exactly its slices (a tensor-parallel rank never held a full tensor it does not serve). Deltas send what
changed. Overlapping pieces, a gap, a wrong full shape and a rank that dies mid-transfer are refused with the
fleet on its old epoch, still serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file, save_file

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.client.llm import MegatronLLM
from megatron_serve.config import InferenceConfig
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import Children, free_port, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "1 2 3 4", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)
TRAINER = Path(__file__).with_name("sharded_trainer.py")
BUCKET = 16 << 10


def outputs(model_dir: str) -> list[list[int]]:
    with MegatronLLM(model_dir, InferenceConfig(num_kv_blocks=64)) as llm:
        return [r.generated_tokens for r in llm.generate(PROMPTS, GREEDY)]


def changed_layer(model_dir: str, out: Path, layer: int) -> str:
    """A copy of ``model_dir`` whose layer ``layer`` has every weight + 1 (what ``--change-layer`` sends)."""
    out.mkdir()
    for item in Path(model_dir).iterdir():
        if item.name != "model.safetensors":
            (out / item.name).symlink_to(item)
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    marker = f"model.layers.{layer}."
    save_file({n: t + 1 if n.startswith(marker) else t for n, t in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded-refit")
    a, b = str(make_tiny_model(root / "a", seed=0)), str(make_tiny_model(root / "b", seed=1))
    b1 = changed_layer(b, root / "b1", 1)
    state = load_file(str(Path(b) / "model.safetensors"))
    expected = SimpleNamespace(a=outputs(a), b=outputs(b), b1=outputs(b1))
    assert len({str(expected.a), str(expected.b), str(expected.b1)}) == 3
    return SimpleNamespace(a=a, b=b, expected=expected, state=state)


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    children = Children(tmp_path_factory.mktemp("sharded-refit-logs"))
    port = free_port()
    children.coordinator(models.a, port)
    children.engine(models.a, port, "--group", "0")
    children.engine(models.a, port, "--group", "1", "--tensor-parallel", "2")
    try:
        yield SimpleNamespace(address=f"tcp://127.0.0.1:{port}", children=children)
    finally:
        children.kill_all()


def run_trainers(fleet, model: str, epoch: int, world_size: int, *extra: str,
                 rank_extra: dict[int, list[str]] | None = None) -> list[tuple[int, list[dict]]]:
    """Every trainer rank as its own process, side by side; each one's exit code and JSON lines."""
    trainer_port = free_port()
    procs = [subprocess.Popen([sys.executable, str(TRAINER), fleet.address, model, str(epoch), str(rank),
                               str(world_size), str(trainer_port), "--bucket-bytes", str(BUCKET), *extra,
                               *(rank_extra or {}).get(rank, [])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "MEGATRON_SERVE_TOKEN": fleet.children.secret})
             for rank in range(world_size)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert lines or proc.returncode < 0, err[-3000:]
        results.append((proc.returncode, lines))
    return results


async def assert_serves(client: InferenceClient, expected: list[list[int]], epoch: int) -> None:
    results = await asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS))
    assert [r.generated_tokens for r in results] == expected
    assert all(set(r.policy_epochs) == {epoch} for r in results)


async def test_two_trainer_ranks_refit_a_fleet_each_with_its_own_pieces(fleet, models):
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await client.wait_for_engines(2, timeout=300)
        await assert_serves(client, models.expected.a, 0)
        await client.pause()
        results = await asyncio.to_thread(run_trainers, fleet, models.b, 3, 2)
        assert [code for code, _ in results] == [0, 0], results
        acks = [lines[-1] for _, lines in results]
        assert all(ack["state"] == "PAUSED" and ack["detail"]["epoch"] == 3 for ack in acks)
        senders = [ack["detail"]["sender"] for ack in acks]
        assert [s["rank"] for s in senders] == [0, 1] and all(s["world_size"] == 5 for s in senders)
        # engine ranks: 2 (group 0, serves everything), 3 and 4 (group 1's tensor-parallel ranks)
        receivers = {int(r): facts for r, facts in acks[0]["detail"]["receivers"].items()}
        assert sorted(receivers) == [2, 3, 4]
        held = [lines[0]["holds"] for _, lines in results]
        for rank, sender in enumerate(senders):
            # each rank's acknowledgement counts its own bytes: to the engine rank that serves everything,
            # exactly the pieces this rank holds; to the tensor-parallel ranks, less
            assert sender["links"]["2"] == held[rank], (rank, sender)
            assert sender["links"].get("3", 0) + sender["links"].get("4", 0) < 1.2 * held[rank]
            assert sender["bytes"] == sum(sender["links"].values()) and sender["skipped_bytes"] == 0
        assert sum(s["bytes"] for s in senders) == sum(f["bytes"] for f in receivers.values())
        total = sum(t.numel() * t.element_size() for t in models.state.values())
        largest = max(t.numel() * t.element_size() for t in models.state.values())
        assert receivers[2]["bytes"] == receivers[2]["serves_bytes"] == total
        for rank in (3, 4):  # every byte of its slices and nothing else: about half the model, no full tensor
            assert receivers[rank]["bytes"] == receivers[rank]["serves_bytes"] < 0.55 * total
            assert receivers[rank]["largest_tensor_bytes"] == largest // 2
        assert all(lines[0]["largest"] <= largest // 2 for _, lines in results)  # nor did a trainer rank
        await client.unpause()
        await assert_serves(client, models.expected.b, 3)


async def test_a_delta_sends_only_what_changed(fleet, models):
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await client.pause()
        status = await client.status()
        if status["epoch"] != 3:
            results = await asyncio.to_thread(run_trainers, fleet, models.b, 3, 2)
            assert [code for code, _ in results] == [0, 0], results

        def sent(results) -> tuple[int, int]:
            assert [code for code, _ in results] == [0, 0], results
            senders = [lines[-1]["detail"]["sender"] for _, lines in results]
            return sum(s["bytes"] for s in senders), sum(s["skipped_bytes"] for s in senders)

        # after a full refit the engines hold no digests: the first delta sends everything, with its digests
        first = sent(await asyncio.to_thread(run_trainers, fleet, models.b, 4, 2, "--delta"))
        assert first[0] > 0 and first[1] == 0
        again = sent(await asyncio.to_thread(run_trainers, fleet, models.b, 5, 2, "--delta"))
        assert sum(again) == first[0] and again[0] <= 0.02 * first[0]  # unchanged: (almost) nothing travels
        await client.unpause()
        await assert_serves(client, models.expected.b, 5)

        await client.pause()
        layer_1 = sent(await asyncio.to_thread(run_trainers, fleet, models.b, 6, 2, "--delta", "--change-layer", "1"))
        layer = {n: t.numel() * t.element_size() for n, t in models.state.items() if n.startswith("model.layers.1.")}
        norms = sum(size for name, size in layer.items() if "norm" in name)
        # layer 1 once to group 0, once in slices to group 1, whose ranks both hold the (replicated) norms
        assert layer_1[0] == 2 * sum(layer.values()) + norms and sum(layer_1) == first[0]
        await client.unpause()
        await assert_serves(client, models.expected.b1, 6)


@pytest.mark.parametrize("flag, message", [("--overlap", "overlap at"), ("--gap", "leave a gap"),
                                           ("--wrong-shape", "trainer ranks disagree on")])
async def test_bad_pieces_are_refused_before_any_engine_changes(fleet, models, flag, message):
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await client.pause()
        before = (await client.status())["epoch"]
        results = await asyncio.to_thread(run_trainers, fleet, models.a, 9, 2, rank_extra={1: [flag]})
        assert [code for code, _ in results] == [1, 1]
        for _, lines in results:  # every rank says why, the same way
            assert lines[-1]["type"] == "ValueError" and message in lines[-1]["error"], lines[-1]
        status = await client.status()
        assert status["epoch"] == before and all(e["epoch"] == before for e in status["engines"])
        await client.unpause()


async def test_a_rank_that_dies_mid_transfer_leaves_every_engine_on_its_old_epoch(fleet, models):
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await client.pause()
        status = await client.status()
        before = status["epoch"]
        expected = {3: models.expected.b, 5: models.expected.b, 6: models.expected.b1}.get(before)
        # the transfer's default timeout: the dying rank's peers notice its closed connections at once, while a
        # short one (20 s: engines joining, each message) can fail rank 1 before its second bucket under load
        results = await asyncio.to_thread(run_trainers, fleet, models.a, 11, 2,
                                          rank_extra={1: ["--die-after-bucket", "2"]})
        (code0, lines0), (code1, lines1) = results
        assert code1 == -9 and lines1[-1]["bucket"] == 2, results
        assert code0 == 1 and "no weights were changed" in lines0[-1]["error"], lines0[-1]

        async def settled():
            status = await client.status()
            return status if not status["pending_controls"] else None

        status = await until(settled, 120, "the broken REFIT to be answered")
        assert status["epoch"] == before and not status["incomplete_weights"]
        assert all(e["epoch"] == before for e in status["engines"])
        await client.unpause()  # nothing changed: the fleet serves on
        if expected is not None:
            await assert_serves(client, expected, before)
