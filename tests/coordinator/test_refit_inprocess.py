"""REFIT through a real coordinator and engine processes over sockets, with fake engines (fast).

The consistency rules: verify on every engine before any engine loads; an engine whose load fails
after verification leaves the fleet, registers again and loads the fleet's weights; engines that
join later load them too; a restarted coordinator adopts the epoch its engines report; an engine
started from another model (a rolling replacement) is flagged, not synced.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from megatron_serve.client.coordinator_client import ControlError, InferenceClient
from megatron_serve.wire.sampling_params import SamplingParams

from .fakes import FakeEngine, expected_tokens
from ..helpers import until
from ..inprocess_fleet import InProcessFleet

pytestmark = pytest.mark.timeout(120)


class RefitFake(FakeEngine):
    """A fake engine that can refit: ``bad`` sources fail verification, ``fail_once`` fail one load."""

    def __init__(self, bad: tuple[str, ...] = (), fail_once: tuple[str, ...] = (), **kwargs) -> None:
        super().__init__(**kwargs)
        self.bad = set(bad)
        self.fail_once = set(fail_once)
        self.verified: list[str] = []
        self.loaded: list[tuple[str, int]] = []

    def verify_refit(self, source: str) -> float:
        if source in self.bad:
            raise ValueError(f"{source}: hidden_size is 96 but the serving model has 64")
        self.verified.append(source)
        return 0.001

    def refit(self, source: str, epoch: int | None = None) -> dict:
        self.verify_refit(source)
        if source in self.fail_once:
            self.fail_once.discard(source)
            self.epoch = -1
            raise OSError(f"{source}: read error in the middle of the load")
        self.epoch = self.epoch + 1 if epoch is None else epoch
        self.loaded.append((source, self.epoch))
        return {"epoch": self.epoch, "verify_s": 0.001, "load_s": 0.002, "total_s": 0.003}


def add(fleet, fake: FakeEngine, model: str | None = None) -> FakeEngine:
    return fleet.add_engine(fake=fake, info={"model": model} if model else None)[1]


@contextlib.asynccontextmanager
async def paused(fleet: InProcessFleet, engines: int) -> AsyncIterator[InferenceClient]:
    """A client of ``fleet`` once ``engines`` engines registered, the fleet paused (where a refit may start)."""
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        await client.wait_for_engines(engines, timeout=20, poll=0.02)
        await client.pause()
        yield client


async def status_when(client: InferenceClient, check, what: str) -> dict:
    async def probe():
        status = await client.status()
        return status if check(status) else None
    return await until(probe, 20, what)


async def test_refit_is_refused_while_running_and_without_engines(fleet_factory):
    fleet = fleet_factory()
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        with pytest.raises(ControlError, match="the fleet is RUNNING") as err:
            await client.refit("/m/b")
        assert err.value.code == "illegal_transition"
        await client.pause()
        with pytest.raises(ControlError, match="at least one connected engine") as err:
            await client.refit("/m/b")
        assert err.value.code == "refit_failed"
        with pytest.raises(ValueError, match="epoch"):
            await client.refit("/m/b", epoch=-1)
        assert (await client.status())["epoch"] == 0


async def test_a_source_one_engine_refuses_is_loaded_by_none(fleet_factory):
    fleet = fleet_factory()
    good, picky = add(fleet, RefitFake()), add(fleet, RefitFake(bad=("/m/wide",)))
    async with paused(fleet, 2) as client:
        with pytest.raises(ControlError, match=r"refused by engine .*hidden_size is 96.*keeps serving epoch 0"):
            await client.refit("/m/wide")
        assert good.verified == ["/m/wide"] and good.loaded == [] and picky.loaded == []
        status = await client.status()
        assert status["epoch"] == 0 and status["weights"] is None and status["state"] == "PAUSED"
        ack = await client.refit("/m/b")  # the next good one goes through, epoch = current + 1
        assert ack["detail"]["epoch"] == 1 and good.loaded == picky.loaded == [("/m/b", 1)]
        await client.unpause()
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=3)
        result = await client.add_request([1, 2, 3], params)
        assert result.generated_tokens == expected_tokens([1, 2, 3], 3)


async def test_an_engine_whose_load_fails_registers_again_and_loads_the_fleet_weights(fleet_factory):
    fleet = fleet_factory()
    steady, flaky = add(fleet, RefitFake()), add(fleet, RefitFake(fail_once=("/m/b",)))
    async with paused(fleet, 2) as client:
        ack = await client.refit("/m/b", epoch=4)
        assert ack["detail"]["epoch"] == 4 and len(ack["detail"]["failed"]) == 1
        assert "read error" in next(iter(ack["detail"]["failed"].values()))
        # as for a late engine: it loads on its own thread, a moment after STATUS lists it again
        status = await status_when(client, lambda s: len(s["engines"]) == 2 and not s["epoch_mismatch"]
                                   and flaky.loaded, "the flaky engine back on epoch 4")
        assert {e["epoch"] for e in status["engines"]} == {4}
        assert steady.loaded == [("/m/b", 4)] and flaky.loaded == [("/m/b", 4)]  # at its new registration


async def test_late_engines_load_the_current_weights_and_a_restarted_coordinator_adopts_them(fleet_factory):
    fleet = fleet_factory()
    first = add(fleet, RefitFake())
    async with paused(fleet, 1) as client:
        await client.refit("/m/b", epoch=3)
        late = add(fleet, RefitFake())
        # It loads on its own thread, a moment after STATUS already lists it: wait for the load.
        status = await status_when(client, lambda s: len(s["engines"]) == 2 and late.loaded
                                   and not s["epoch_mismatch"], "the late engine loaded")
        assert late.loaded == [("/m/b", 3)] and status["epoch_mismatch"] == []
        assert first.loaded == [("/m/b", 3)]
    fleet.stop_coordinator()
    fleet.start_coordinator()  # same port; it knows nothing about epochs until the engines register
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        status = await status_when(client, lambda s: len(s["engines"]) == 2, "engines registered again")
        assert status["epoch"] == 3 and status["weights"] == "/m/b" and status["epoch_mismatch"] == []
        assert first.loaded == late.loaded == [("/m/b", 3)]  # nothing loaded twice


async def test_an_engine_of_another_model_is_flagged_not_synced(fleet_factory):
    fleet = fleet_factory()
    fleet.coordinator.core.weights.model = "/m/a"
    add(fleet, RefitFake(), model="/m/a")
    async with paused(fleet, 1) as client:
        await client.refit("/m/b")
        other = add(fleet, RefitFake(), model="/m/new")  # a rolling replacement's engine
        same = add(fleet, RefitFake(), model="/m/a/")
        # The fakes load on their own threads, a moment after STATUS already lists them: wait for the load.
        status = await status_when(client, lambda s: len(s["engines"]) == 3 and same.loaded
                                   and len(s["epoch_mismatch"]) <= 1, "three engines, the joiner refitted")
        assert other.loaded == [] and same.loaded == [("/m/b", 1)]
        assert len(status["epoch_mismatch"]) == 1
        flagged = next(e for e in status["engines"] if e["id"] == status["epoch_mismatch"][0])
        assert flagged["epoch"] == 0 and flagged["info"]["model"] == "/m/new"
