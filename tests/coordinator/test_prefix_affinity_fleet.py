"""``--routing prefix_affinity`` against ``least_loaded`` with real processes on 127.0.0.1.

One fleet: a coordinator and 3 ``megatron-serve engine`` processes (3 engine groups, prefix
caching on, block size 16). Each burst of requests is queued while the fleet is PAUSED and
dispatched at UNPAUSE in one pass of the coordinator's loop, with no request finishing in between,
so how many requests each group gets is exact. The second test restarts the coordinator with
``least_loaded`` on the same port; the engines join it again on their own.

The load bound under test is the policy's (``megatron_serve.coordinator.prefix_routing``): a group is skipped
when it has more than ``m + max(4, 0.5 * m)`` requests in flight, ``m`` being the least-loaded
group's count.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.coordinator.prefix_routing import DEFAULT_MAX_LOAD_GAP
from megatron_serve.wire.request import RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import process_fleet

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

BLOCK = 16
PREFIX_BLOCKS = 3
ENGINE_ARGS = ("--max-requests", "8", "--block-size", str(BLOCK), "--prefix-caching", "--coordinator-timeout", "3")
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True)
_rng = random.Random(8)
PREFIXES = {name: [_rng.randrange(5, 500) for _ in range(PREFIX_BLOCKS * BLOCK)] for name in "ABC"}
_serial = iter(range(10_000))


def prompt(family: str) -> list[int]:
    """The family's 3-block prefix plus a tail of its own (5 tokens)."""
    n = next(_serial)
    return PREFIXES[family] + [5 + (n * 7 + k) % 490 for k in range(5)]


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    with process_fleet(tmp_path_factory.mktemp("prefix-affinity-logs"), tiny_model, [ENGINE_ARGS] * 3,
                       ("--routing", "prefix_affinity")) as state:
        yield state


async def connect(fleet) -> InferenceClient:
    client = InferenceClient(fleet.address, token=fleet.children.secret)
    await client.start(timeout=60)
    status = await client.wait_for_engines(3, timeout=300)
    if status["state"] != "RUNNING":
        await client.unpause()
    return client


async def until_status(client: InferenceClient, predicate, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = await client.status()
        if predicate(status):
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}: {status}")
        await asyncio.sleep(0.05)


async def burst(client: InferenceClient, prompts: list[list[int]]) -> tuple[dict[int, int], list]:
    """Queue ``prompts`` on a paused fleet, dispatch them at once; returns requests completed per group."""
    await client.pause()
    before = {e["group"]: e["completed"] for e in (await client.status())["engines"]}
    futures = [client.add_request(p, PARAMS) for p in prompts]
    await until_status(client, lambda s: s["queued"] == len(prompts), 30, f"{len(prompts)} queued requests")
    await client.unpause()
    results = await asyncio.wait_for(asyncio.gather(*futures), 300)
    assert all(r.status is RequestStatus.COMPLETED for r in results)
    status = await until_status(client, lambda s: s["in_flight"] == 0, 30, "no request in flight")
    return {e["group"]: e["completed"] - before.get(e["group"], 0) for e in status["engines"]}, results


async def test_prefix_affinity_keeps_a_prefix_on_one_group_within_the_load_bound(fleet):
    client = await connect(fleet)
    try:
        status = await client.status()
        assert status["routing"] == "prefix_affinity"
        assert all(e["info"]["block_size"] == BLOCK and e["info"]["prefix_caching"] for e in status["engines"])

        # One request per family: no group holds anything yet, so each goes to the least-loaded group.
        served, _ = await burst(client, [prompt(f) for f in "ABC"])
        assert sorted(served.values()) == [1, 1, 1], served

        # Four more of family A (within the bound of 4 above the least-loaded group): all on A's group,
        # and each finds A's prefix in that engine's cache.
        served, results = await burst(client, [prompt("A") for _ in range(4)])
        assert sorted(served.values()) == [0, 0, 4], served
        home = max(served, key=served.get)
        assert all(r.cached_tokens == PREFIX_BLOCKS * BLOCK for r in results), [r.cached_tokens for r in results]

        # A hot prefix: 12 at once. Its group takes requests while it has at most m + 4 in flight
        # (m = the least-loaded group's count, 0 here), i.e. 5; then the prefix spills to the
        # least-loaded group, which takes 5 as well, and the last group gets the rest.
        hot = 12
        served, _ = await burst(client, [prompt("A") for _ in range(hot)])
        share = DEFAULT_MAX_LOAD_GAP + 1
        assert served[home] == share, served
        assert sorted(served.values()) == sorted([share, share, hot - 2 * share]), served

        # The engines' prefix-cache counters reach STATUS with their heartbeats, and the control CLI.
        def counters_arrived(s: dict) -> bool:
            by_group = {e["group"]: e for e in s["engines"]}
            return (by_group[home]["cached_tokens"] >= (4 + share - 1) * PREFIX_BLOCKS * BLOCK
                    and all(e["computed_tokens"] > 0 for e in s["engines"]))

        await until_status(client, counters_arrived, 30, "the engines' cache counters in STATUS")
        out = subprocess.run([sys.executable, "-m", "megatron_serve.cli", "control", "status", "--json",
                              "--coordinator", fleet.address], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "MEGATRON_SERVE_TOKEN": fleet.children.secret})
        assert out.returncode == 0, out.stderr
        engines = json.loads(out.stdout)["engines"]
        assert len(engines) == 3 and all(isinstance(e["cached_tokens"], int) and e["computed_tokens"] > 0
                                         for e in engines)
    finally:
        client.close()


async def test_least_loaded_spreads_the_same_prefix(fleet):
    fleet.coordinator.send_signal(signal.SIGTERM)
    fleet.coordinator.wait(30)
    fleet.coordinator = fleet.children.coordinator(fleet.model, fleet.port, "--routing", "least_loaded")
    client = await connect(fleet)
    try:
        assert (await client.status())["routing"] == "least_loaded"
        served, _ = await burst(client, [prompt("A") for _ in range(4)])
        assert sorted(served.values()) == [1, 1, 2], served
        served, _ = await burst(client, [prompt("A") for _ in range(12)])
        assert sorted(served.values()) == [4, 4, 4], served
    finally:
        client.close()
