"""Weights straight from a trainer process into a real fleet (issue 15's acceptance), gloo on CPU.

A coordinator and two engine groups (one of them tensor-parallel 2) serve model A; a separate
trainer process (``trainer.py``: a ``transformers`` model of B, a ``WeightSender``) pushes B's
weights in buckets. Afterwards greedy outputs equal a fresh direct-mode ``MegatronLLM`` on B,
token for token, with the new epoch on every token. A wrong name or shape is refused before any
engine changes; a trainer killed mid-transfer leaves every engine on its old weights and epoch
(they load only once every rank of the transfer committed); an engine that joins later with no live engine of its
layout to pull the weights from (two pipeline stages: no group here has them; tests/weights/test_peer_pull_fleet.py
pulls) gets no requests until a refit includes it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_serve.client.coordinator_client import ControlError, InferenceClient
from megatron_serve.wire.sampling_params import SamplingParams
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve import WeightSender

from ..helpers import greedy_tokens, process_fleet, until
from ..forked import run_scripts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "1 2 3 4", "def add(a, b):",
           "Once upon a time", "Kubernetes runs containers in pods"]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)
TRAINER = Path(__file__).with_name("trainer.py")
BUCKET = 64 << 10  # a few buckets for a tiny model, so that a trainer can die between two


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight-sync")
    a, b = str(make_tiny_model(root / "a", seed=0)), str(make_tiny_model(root / "b", seed=1))
    expected = SimpleNamespace(a=greedy_tokens(a, PROMPTS, GREEDY), b=greedy_tokens(b, PROMPTS, GREEDY))
    assert expected.a != expected.b
    return SimpleNamespace(a=a, b=b, expected=expected)


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    engines = [("--group", "0"), ("--group", "1", "--tensor-parallel", "2")]
    with process_fleet(tmp_path_factory.mktemp("weight-sync-logs"), models.a, engines) as fleet:
        yield fleet


def run_trainer(fleet, model: str, epoch: int, *extra: str) -> tuple[int, list[dict]]:
    """The trainer as its own process (forked from one that imported torch), holding the fleet secret; returns its
    exit code and the JSON lines it printed."""
    [ended] = run_scripts(TRAINER, [[fleet.address, model, str(epoch), str(BUCKET), *extra]],
                          {"MEGATRON_SERVE_TOKEN": fleet.children.secret}, timeout=600, via="forkserver")
    lines = [json.loads(line) for line in ended.stdout.splitlines() if line.startswith("{")]
    assert lines or ended.returncode < 0, ended.stderr[-3000:]
    return ended.returncode, lines


async def assert_serves(client: InferenceClient, expected: list[list[int]], epoch: int) -> None:
    """Greedy outputs are ``expected`` token for token, and every token says ``epoch`` produced it."""
    results = await asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS))
    assert [r.generated_tokens for r in results] == expected
    assert all(set(r.policy_epochs) == {epoch} for r in results)


async def test_a_trainer_process_pushes_weights_into_a_fleet_with_a_tensor_parallel_group(fleet, models):
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await client.wait_for_engines(2, timeout=300)
        await assert_serves(client, models.expected.a, 0)

        # REFIT only while paused: refused at once, and the sender does not wait for engines
        sender = WeightSender(client, backend="gloo", bucket_bytes=BUCKET, timeout=60)
        trainer_b = _trainer_tensors(models.b)
        with pytest.raises(ControlError, match="PAUSE first"):
            await asyncio.wait_for(sender.send(trainer_b, epoch=7), 60)

        await client.pause()
        # a wrong shape or name is refused before any engine changes
        wrong = [*trainer_b[:-1], (trainer_b[-1][0], torch.zeros(3, 3))]
        with pytest.raises(ControlError, match=f"weight {trainer_b[-1][0]}: shape \\(3, 3\\) does not fit") as err:
            await asyncio.wait_for(sender.send(wrong, epoch=7), 120)
        assert err.value.code == "refit_failed"
        with pytest.raises(ControlError, match="'model.layers.0.mlp.gate.weight' has no place"):
            await asyncio.wait_for(sender.send([("model.layers.0.mlp.gate.weight", torch.zeros(4, 64))]), 120)
        status = await client.status()
        assert status["epoch"] == 0 and all(e["epoch"] == 0 for e in status["engines"])

        code, lines = await asyncio.to_thread(run_trainer, fleet, models.b, 7)
        ack = lines[-1]
        assert code == 0, lines
        assert ack["state"] == "PAUSED" and ack["detail"]["epoch"] == 7
        assert ack["detail"]["source"].startswith("rendezvous://127.0.0.1:")
        sent = ack["detail"]["sender"]
        assert sent["world_size"] == 4 and sent["buckets"] > 2
        receivers = ack["detail"]["receivers"]  # engine rank 1 (group 0) serves everything, 2 and 3 their slices
        assert receivers["1"]["bytes"] == _nbytes(trainer_b)
        assert all(receivers[r]["bytes"] < 0.55 * _nbytes(trainer_b) for r in ("2", "3"))  # half, norms replicated
        assert sent["bytes"] == sum(f["bytes"] for f in receivers.values())
        engines = ack["detail"]["engines"]
        assert sorted(f["ranks"] for f in engines.values()) == [[1, 1], [2, 3]]
        assert all(f["epoch"] == 7 and f["load_s"] > 0 for f in engines.values())
        await client.unpause()
        await assert_serves(client, models.expected.b, 7)


async def test_a_trainer_killed_mid_transfer_leaves_every_engine_on_its_old_weights(fleet, models):
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await client.pause()
        code, lines = await asyncio.to_thread(run_trainer, fleet, models.a, 8, "--die-after-bucket", "2")
        assert code == -9 and (lines[-1]["bucket"], lines[-1]["of"]) == (2, lines[0]["of"]) and lines[0]["of"] > 2

        async def settled():
            status = await client.status()
            return status if not status["pending_controls"] else None

        # well within the transfer timeout (120 s): every engine rank receives from the trainer directly and
        # notices the closed connection at once; nothing was applied (engines load only after the commit)
        status = await until(settled, 60, "the broken REFIT to be answered")
        assert not status["incomplete_weights"]
        assert all(e["epoch"] == 7 for e in status["engines"]) and status["epoch"] == 7
        await client.unpause()
        await assert_serves(client, models.expected.b, 7)

        await client.pause()
        code, lines = await asyncio.to_thread(run_trainer, fleet, models.b, 9)
        assert code == 0 and lines[-1]["detail"]["epoch"] == 9, lines
        await client.unpause()
        await assert_serves(client, models.expected.b, 9)


async def test_an_engine_that_joins_later_serves_only_once_a_refit_included_it(fleet, models):
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await client.wait_for_engines(2, timeout=300)
        if (await client.status())["epoch"] != 9:  # run without the tests above: a trainer's refit comes first
            await client.pause()
            code, lines = await asyncio.to_thread(run_trainer, fleet, models.b, 9)
            assert code == 0 and lines[-1]["detail"]["epoch"] == 9, lines
            await client.unpause()
        late = fleet.children.engine(models.a, fleet.port, "--group", "5", "--pipeline-parallel-size", "2")  # no donor
        assert fleet.children.refusals == []  # forked by the fleet's launcher, started in another test's setup
        status = await client.wait_for_engines(3, timeout=300)
        joined = next(e for e in status["engines"] if e["group"] == 5)
        assert joined["epoch"] == 0 and status["epoch_mismatch"] == [joined["id"]]
        await assert_serves(client, models.expected.b, 9)  # not from the late engine's (A's) weights
        assert next(e for e in (await client.status())["engines"] if e["group"] == 5)["completed"] == 0

        await client.pause()
        code, lines = await asyncio.to_thread(run_trainer, fleet, models.b, 10)
        detail = lines[-1]["detail"]
        assert code == 0 and len(detail["engines"]) == 3 and detail["sender"]["world_size"] == 6
        await client.unpause()
        for engine in fleet.engines:  # only the late engine is left: it serves B
            engine.terminate()
        for engine in fleet.engines:
            await asyncio.to_thread(engine.wait, 60)
        await assert_serves(client, models.expected.b, 10)
        assert late.poll() is None


def _trainer_tensors(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    return [(n, p.detach()) for n, p in AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            .named_parameters()]


def _nbytes(named: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)
