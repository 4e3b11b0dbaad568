"""An engine that registers while it pulls the fleet's weights reports no step-loop progress until it is done.

A joiner's registration runs its pull (weights.peer_pull) on its main thread; its link thread heartbeats meanwhile,
and the first heartbeat goes at once after the HELLO_ACK. The coordinator reads a heartbeat's ``progress`` as "this
step loop serves" (its stall clock, STATUS, whoever waits for the engine to serve). That first heartbeat carried the
count the main thread had published before the registration whenever the ACK arrived while the main thread was
busy, so for a heartbeat's interval a joiner still pulling looked like one that served: on a loaded host the
peer-pull fleet test saw ``progress`` 1 on both joiners, killed their donors at once, and the joiners sat in their
pulls (a TCP store that was gone) while requests waited on them.

A fake engine (tests/coordinator/fakes.py: no model) over the real coordinator, link and sockets: its main thread is
held in a loop turn when the ACK arrives, then its REGISTER step blocks as a pull does.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.engine.verbs.actions import REGISTER

from ..coordinator.fakes import FakeEngine
from ..helpers import until

pytestmark = pytest.mark.timeout(60)

HEARTBEAT = 0.3


class PullingEngine(FakeEngine):
    """A fake engine whose loop's second turn holds until :attr:`turn_done` is set (a busy main thread: its first turn
    published its count), and whose REGISTER step blocks until :attr:`pulled` is set (a pull of the fleet's weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.turns = 0
        self.busy = threading.Event()
        self.turn_done = threading.Event()
        self.registering = threading.Event()
        self.pulled = threading.Event()

    def idle(self) -> None:
        self.turns += 1
        if self.turns == 2:
            self.busy.set()
            self.turn_done.wait(30)

    def call(self, step, body) -> dict:
        if step == REGISTER:
            self.registering.set()
            self.pulled.wait(30)
        return super().call(step, body)


async def _progress_while(client: InferenceClient, seconds: float) -> tuple[list, int]:
    """The engine's ``progress`` in STATUS at every poll for ``seconds``, and how many heartbeats arrived meanwhile."""
    seen, heartbeats = [], set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        [engine] = (await client.status())["engines"]
        seen.append(engine["progress"])
        heartbeats.add(engine["last_heartbeat"])
        await asyncio.sleep(0.01)
    return seen, len(heartbeats)


async def test_heartbeats_carry_no_progress_until_the_registration_is_done(fleet_factory):
    fleet = fleet_factory()
    fleet.stop_coordinator()  # the engine's loop turns first, then meets the coordinator
    engine = PullingEngine()
    fleet.add_engine(fake=engine, heartbeat_interval=HEARTBEAT)
    assert await asyncio.to_thread(engine.busy.wait, 20)
    fleet.start_coordinator()
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        await until(lambda: _listed(client), 20, "the engine to register", interval=0.01)
        seen, heartbeats = await _progress_while(client, 3 * HEARTBEAT)  # the ACK in, the main thread still busy
        assert heartbeats >= 2 and not engine.registering.is_set()
        assert set(seen) == {None}, f"an engine not done registering reported its loop's progress: {set(seen)}"

        engine.turn_done.set()  # the main thread reads the ACK and pulls
        assert await asyncio.to_thread(engine.registering.wait, 20)
        seen, heartbeats = await _progress_while(client, 3 * HEARTBEAT)
        assert heartbeats >= 2 and not engine.pulled.is_set()
        assert set(seen) == {None}, f"a pulling engine reported its loop's progress: {set(seen)}"

        engine.pulled.set()  # the pull is done: the loop serves, and its count goes out again
        await until(lambda: _progressed(client), 20, "the registered engine's progress")


async def _listed(client: InferenceClient) -> bool:
    return bool((await client.status())["engines"])


async def _progressed(client: InferenceClient) -> bool:
    engines = (await client.status())["engines"]
    return bool(engines) and engines[0]["progress"] is not None
