"""LOAD_LORA and UNLOAD_LORA through a real coordinator and engine processes over sockets (fake engines, fast),
and routing by adapter: a request goes to the engine that already serves its adapter.

The consistency rule is REFIT's: every engine verifies before any loads, so an adapter one engine refuses is
served by none; an unload no engine can do is refused; each acknowledgement updates what STATUS lists.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import msgspec
import pytest

from megatron_serve.client.coordinator_client import ControlError, InferenceClient
from megatron_serve.wire.sampling_params import SamplingParams

from .fakes import FakeEngine, expected_tokens
from .test_refit_inprocess import status_when

pytestmark = pytest.mark.timeout(120)


class LoraFake(FakeEngine):
    """A fake engine with ``enable_lora``: paths starting with ``/bad`` fail the check; it records what ran where."""

    def __init__(self, loras: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.loras = dict(loras or {})
        self.verified: list[str] = []
        self.ran: list[str | None] = []  # the adapter of every request added here

    def lora_adapters(self) -> dict[str, str]:
        return dict(self.loras)

    def verify_lora_adapter(self, name: str, path: str) -> float:
        if path.startswith("/bad"):
            raise ValueError(f"LoRA adapter {name!r}: rank 64 is above --max-lora-rank 16")
        if name in self.loras:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        self.verified.append(name)
        return 0.001

    def load_lora_adapter(self, name: str, path: str) -> float:
        self.verify_lora_adapter(name, path)
        self.loras[name] = path
        return 0.002

    def unload_lora_adapter(self, name: str) -> None:
        del self.loras[name]

    def add_request(self, request, kv_transfer_params=None) -> None:
        self.ran.append(request.sampling_params.lora_name)
        super().add_request(request, kv_transfer_params)


def add(fleet, fake: FakeEngine) -> FakeEngine:
    return fleet.add_engine(fake=fake)[1]


def served(status: dict) -> list[dict | None]:
    return [engine["loras"] for engine in status["engines"]]


async def test_load_is_verified_everywhere_first_and_unload_reaches_every_engine(fleet_factory):
    fleet = fleet_factory()
    first, second = add(fleet, LoraFake()), add(fleet, LoraFake())
    async with fleet.connected(2) as client:
        ack = await client.load_lora_adapter("sql", "/adapters/sql")
        assert ack["state"] == "RUNNING" and ack["detail"]["lora_name"] == "sql" and not ack["detail"]["noop"]
        assert all(f["loras"] == {"sql": "/adapters/sql"} and "load_s" in f for f in ack["detail"]["engines"].values())
        assert first.loras == second.loras == {"sql": "/adapters/sql"}
        assert served(await client.status()) == [{"sql": "/adapters/sql"}] * 2  # at once, before a heartbeat

        with pytest.raises(ControlError, match=r"refused by engine .*rank 64 is above --max-lora-rank 16.*no engine"
                                               r" serves it") as err:
            await client.load_lora_adapter("big", "/bad/big")
        assert err.value.code == "lora_refused"
        with pytest.raises(ControlError, match="'sql' is already loaded") as err:
            await client.load_lora_adapter("sql", "/adapters/other")
        assert err.value.code == "lora_refused"
        assert first.loras == second.loras == {"sql": "/adapters/sql"}  # nothing changed anywhere
        assert "big" not in first.verified + second.verified

        await client.unload_lora_adapter("sql")
        assert first.loras == second.loras == {}
        with pytest.raises(ControlError, match="'sql' cannot be found: no engine serves it") as err:
            await client.unload_lora_adapter("sql")
        assert err.value.code == "lora_not_found"
        with pytest.raises(ValueError, match="lora_path must be a non-empty string"):
            await client.load_lora_adapter("x", "")
        await client.pause()  # legal while paused too, and the state stays
        assert (await client.load_lora_adapter("sql", "/adapters/sql"))["state"] == "PAUSED"


async def test_load_is_refused_while_stopped_and_by_an_engine_without_lora(fleet_factory):
    fleet = fleet_factory()
    add(fleet, LoraFake())
    add(fleet, FakeEngine())  # started without enable_lora
    async with fleet.connected(2) as client:
        with pytest.raises(ControlError, match="need an engine started with enable_lora") as err:
            await client.load_lora_adapter("sql", "/adapters/sql")
        assert err.value.code == "lora_refused"
        assert sorted(served(await client.status()), key=str) == [None, {}]  # nothing loaded on the LoRA engine
        await client.stop()
        with pytest.raises(ControlError, match="LOAD_LORA is not allowed while STOPPED") as err:
            await client.load_lora_adapter("sql", "/adapters/sql")
        assert err.value.code == "illegal_transition"


async def test_an_engine_that_joins_later_loads_the_adapters_the_fleet_loaded(fleet_factory):
    fleet = fleet_factory()
    first = add(fleet, LoraFake(loras={"boot": "/adapters/boot"}))
    async with fleet.connected(1) as client:
        await client.load_lora_adapter("sql", "/adapters/sql")
        await client.load_lora_adapter("gone", "/adapters/gone")
        await client.unload_lora_adapter("gone")
        late = add(fleet, LoraFake())
        status = await status_when(client, lambda s: len(s["engines"]) == 2 and all(e["loras"] for e in s["engines"]),
                                   "the late engine serving the fleet's adapters")
        assert late.loras == {"sql": "/adapters/sql"}  # not --lora-modules of another engine, nor an unloaded one
        assert first.loras == {"boot": "/adapters/boot", "sql": "/adapters/sql"}
        assert sorted(map(len, served(status))) == [1, 2]


async def test_requests_go_to_the_engine_that_serves_their_adapter(fleet_factory):
    fleet = fleet_factory(routing="round_robin")  # left alone it would alternate between the two
    plain, holder = add(fleet, LoraFake()), add(fleet, LoraFake(loras={"sql": "/adapters/sql"}))
    async with fleet.connected(2) as client:
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=3)
        tuned = msgspec.structs.replace(params, lora_name="sql")
        results = [await client.add_request([1, 2, 3 + i], tuned) for i in range(4)]
        assert all(r.generated_tokens == expected_tokens([1, 2, 3 + i], 3) for i, r in enumerate(results))
        assert holder.ran == ["sql"] * 4 and plain.ran == []
        base = [await client.add_request([5, 6, i], params) for i in range(4)]  # the base model: either engine
        assert len(base) == 4 and plain.ran == [None, None] and holder.ran.count(None) == 2


def _control(fleet, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_serve.cli", "control", *args, "--coordinator", fleet.address],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEGATRON_SERVE_TOKEN": fleet.token})


async def test_the_control_command_loads_and_unloads_and_names_what_is_wrong(fleet_factory):
    fleet = fleet_factory()
    engine = add(fleet, LoraFake())
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        await client.wait_for_engines(1, timeout=20, poll=0.02)
    loaded = await asyncio.to_thread(_control, fleet, "load_lora", "--lora-name", "sql", "--lora-path", "/a/sql")
    assert loaded.returncode == 0 and "LoRA adapter 'sql' served" in loaded.stdout, loaded.stderr
    assert engine.loras == {"sql": "/a/sql"}
    refused = await asyncio.to_thread(_control, fleet, "load_lora", "--lora-name", "big", "--lora-path", "/bad/big")
    assert refused.returncode == 1 and "load_lora refused by the coordinator" in refused.stderr
    assert "rank 64 is above --max-lora-rank 16" in refused.stderr and engine.loras == {"sql": "/a/sql"}
    no_path = await asyncio.to_thread(_control, fleet, "load_lora", "--lora-name", "x")
    assert no_path.returncode == 1 and "load_lora needs --lora-path DIR" in no_path.stderr
    misplaced = await asyncio.to_thread(_control, fleet, "pause", "--lora-name", "x")
    assert misplaced.returncode == 1 and "--lora-name applies to load_lora and unload_lora only" \
        in misplaced.stderr
    unloaded = await asyncio.to_thread(_control, fleet, "unload_lora", "--lora-name", "sql", "--json")
    assert unloaded.returncode == 0 and json.loads(unloaded.stdout)["detail"]["lora_name"] == "sql"
    assert engine.loras == {}
