"""In-place weight refit through a real fleet: ``megatron-serve coordinator`` + 2 engine processes.

Acceptance of issue 9 on a tiny model: generate, pause, refit to a second checkpoint with other
random weights, unpause: new requests equal direct mode on the second checkpoint; requests in
flight across the refit complete and their per-token epochs show the switch. A checkpoint of
another hidden size is refused with a clear error and the fleet keeps serving the old weights;
REFIT while RUNNING is refused; an engine that joins later loads the fleet's current weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_serve.client.coordinator_client import ControlError, InferenceClient, StreamPartial
from megatron_serve.wire.sampling_params import SamplingParams
from megatron_serve.model.tiny import make_tiny_model

from ..helpers import greedy_tokens, pending, process_fleet, run_in_pulses, while_held

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "1 2 3 4", "def add(a, b):",
           "Once upon a time", "Kubernetes runs containers in pods"]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)
# Running when PAUSE lands: the engines run in pulses of a few tokens until each stream has its first (run_in_pulses)
LONG = SamplingParams(temperature=0.0, num_tokens_to_generate=200, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("refit-checkpoints")
    return SimpleNamespace(a=tiny_model, b=str(make_tiny_model(root / "b", seed=1)),
                           wide=str(make_tiny_model(root / "wide", seed=2, hidden_size=96)))


@pytest.fixture(scope="module")
def direct(checkpoints):
    a, b = greedy_tokens(checkpoints.a, PROMPTS, GREEDY), greedy_tokens(checkpoints.b, PROMPTS, GREEDY)
    assert a != b
    return SimpleNamespace(a=a, b=b)


@pytest.fixture(scope="module")
def fleet(checkpoints, tmp_path_factory):
    with process_fleet(tmp_path_factory.mktemp("refit-fleet-logs"), checkpoints.a, [(), ()]) as fleet:
        yield fleet


async def generate(client: InferenceClient) -> list[list[int]]:
    results = await asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS))
    return [r.generated_tokens for r in results]


async def test_refit_in_place_through_the_fleet(fleet, checkpoints, direct):
    client = InferenceClient(fleet.address, token=fleet.children.secret)
    await client.start(timeout=60)
    try:
        await client.wait_for_engines(2, timeout=300)
        assert await generate(client) == direct.a

        with pytest.raises(ControlError, match="only allowed while PAUSED or SUSPENDED; the fleet is RUNNING") as err:
            await client.refit(checkpoints.b)
        assert err.value.code == "illegal_transition"

        # requests in flight across the refit: each has produced tokens before the pause
        engines = [e.pid for e in fleet.engines]
        streams = [client.add_request_streaming(p, LONG) for p in PROMPTS[:4]]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        await run_in_pulses(engines, lambda: all(f.done() for f in firsts), "each stream's first tokens")
        assert all(isinstance(f.result(), StreamPartial) and f.result().new_tokens for f in firsts)
        held = await client.status()  # what the coordinator holds as PAUSE goes (the streams still running)
        paused = await while_held(engines, client.pause(), pending(client.status, "PAUSE"))
        ack = await client.refit(checkpoints.b, epoch=5)
        assert ack["state"] == "PAUSED" and ack["detail"]["epoch"] == 5 and ack["detail"]["source"] == checkpoints.b
        engines = ack["detail"]["engines"]
        assert len(engines) == 2
        for facts in engines.values():
            assert facts["epoch"] == 5 and facts["total_s"] >= facts["load_s"] > 0 and "verified_s" in facts
        await client.unpause()

        async def finish(stream):
            async for item in stream:
                if not isinstance(item, StreamPartial):
                    return item

        for result in await asyncio.gather(*(finish(s) for s in streams)):
            assert len(result.generated_tokens) == LONG.num_tokens_to_generate
            assert len(result.policy_epochs) == len(result.kv_epochs) == len(result.generated_tokens)
            assert result.policy_epochs[0] == 0 and result.policy_epochs[-1] == 5, (
                f"first partials {[len(f.result().new_tokens) for f in firsts]}; before PAUSE in flight "
                f"{held['in_flight']}, engines {[(e['running'], e['waiting']) for e in held['engines']]}; "
                f"PAUSE {paused['detail']}")
            assert result.policy_epochs == sorted(result.policy_epochs)  # one switch, 0 -> 5
            assert set(result.kv_epochs) == {0}  # they attended to KV computed under the old weights

        assert await generate(client) == direct.b
        fresh = await client.add_request(PROMPTS[0], GREEDY)
        assert set(fresh.policy_epochs) == set(fresh.kv_epochs) == {5}
        status = await client.status()
        assert status["epoch"] == 5 and status["weights"] == checkpoints.b and status["epoch_mismatch"] == []
        assert all(e["epoch"] == 5 and e["last_refit"]["total_s"] > 0 for e in status["engines"])

        # a checkpoint of another hidden size: refused by every engine, nothing changes
        await client.pause()
        with pytest.raises(ControlError, match="hidden_size is 96 but the serving model has 64") as err:
            await client.refit(checkpoints.wide)
        assert err.value.code == "refit_failed" and "keeps serving epoch 5" in str(err.value)
        await client.unpause()
        assert (await client.status())["epoch"] == 5
        assert await generate(client) == direct.b

        # an engine that joins later (started from the original model) loads the current weights
        late = fleet.children.engine(checkpoints.a, fleet.port, "--group", "7")
        status = await client.wait_for_engines(3, timeout=300)
        joined = next(e for e in status["engines"] if e["group"] == 7)
        assert joined["epoch"] == 5 and joined["weights"] == checkpoints.b and status["epoch_mismatch"] == []
        for engine in fleet.engines:  # only the late engine is left to serve: its outputs are those of b
            engine.terminate()
        for engine in fleet.engines:
            await asyncio.to_thread(engine.wait, 60)
        assert late.poll() is None
        assert await generate(client) == direct.b
        assert "loads the fleet's epoch 5" in fleet.children.log_of(late) or \
            "loading it before serving" in fleet.children.log_of(late)
    finally:
        client.close()


async def test_control_cli_refit(fleet, checkpoints):
    """``megatron-serve control refit`` prints the new epoch; refused while RUNNING with one clear line. The pause
    and unpause around it go from here (the CLI's own are tested in test_fleet: a process each cost more)."""
    base = [sys.executable, "-m", "megatron_serve.cli", "control"]
    where = ["--coordinator", fleet.address]
    env = {**os.environ, "MEGATRON_SERVE_TOKEN": fleet.children.secret}

    def control(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*base, *args, *where], capture_output=True, text=True, timeout=120, env=env)

    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        refused = await asyncio.to_thread(control, "refit", "--source", checkpoints.b)
        assert refused.returncode != 0 and "PAUSE first" in refused.stderr
        await client.pause()
        out = await asyncio.to_thread(control, "refit", "--source", checkpoints.b, "--json")
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        assert answer["state"] == "PAUSED" and answer["detail"]["epoch"] == 6  # current + 1
        text = await asyncio.to_thread(control, "status")
        assert "epoch: 6" in text.stdout
        await client.unpause()
