"""What generation requests read of the fleet's status (the engines' smallest context limit, their adapters) follows
each status the monitor takes, though it is read once per status."""

from __future__ import annotations

import asyncio
from typing import Any

from megatron_serve.server.fleet import FleetMonitor


class _Backend:
    """A coordinator's status, a new object per poll, of the engines it is given."""

    connected = True

    def __init__(self) -> None:
        self.engines: list[dict[str, Any]] = []

    async def status(self, timeout: float | None = None) -> dict[str, Any]:
        return {"state": "RUNNING", "engines": [dict(engine) for engine in self.engines]}


def test_the_limit_and_adapters_are_those_of_the_last_status():
    async def run() -> None:
        backend = _Backend()
        monitor = FleetMonitor(backend)
        assert monitor.max_sequence_length() is None and monitor.adapters() is None  # no status yet
        backend.engines = [{"info": {"max_sequence_length": 2048}}, {"info": {"max_sequence_length": 1024}}]
        await monitor.refresh()
        assert monitor.max_sequence_length() == 1024 and monitor.adapters() is None
        backend.engines = [{"info": {"max_sequence_length": 512}, "loras": {"sql": "/a/sql"}},
                           {"info": {"max_sequence_length": True}, "loras": {"chat": "/a/chat"}}]
        assert monitor.max_sequence_length() == 1024  # what the monitor has seen, until it polls
        await monitor.refresh()
        assert monitor.max_sequence_length() == 512
        assert monitor.adapters() == {"sql": "/a/sql", "chat": "/a/chat"}
        backend.engines = []
        await monitor.refresh()
        assert monitor.max_sequence_length() is None and monitor.adapters() is None

    asyncio.run(run())
