"""PAUSE's modes on a real fleet (``megatron-serve coordinator`` + 2 engine processes) with requests in flight.

Each mode's contract, and that no request is lost or duplicated: every request ends exactly once,
its streamed tokens are its result's tokens, and the tokens are direct mode's (or, for ``abort``,
a prefix of them that a resubmission continues to the same end).

Engines run at most 2 requests at once (and are given 4), so that some requests run, some wait on
an engine and some are queued at the coordinator when the fleet pauses.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_serve.client.coordinator_client import InferenceClient, StreamPartial
from megatron_serve.config import InferenceConfig
from megatron_serve.wire.request import DynamicInferenceRequest, FinishReason, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import pending, process_fleet, run_in_pulses, until, while_held

pytestmark = pytest.mark.timeout(600)

PROMPTS = [f"Rollout {i}: {' '.join(['a trainer samples'] * (1 + i % 3))} number {i}" for i in range(16)]
LONG = 160  # tokens per request: long enough to be running when the verb arrives
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=LONG, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, num_tokens_to_generate=24, ignore_eos=True)


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    with process_fleet(tmp_path_factory.mktemp("pause-modes-logs"), tiny_model, [("--max-requests", "2")] * 2) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def direct(tiny_model):
    from megatron_serve.api.llm import MegatronLLM

    with MegatronLLM(tiny_model, InferenceConfig(num_kv_blocks=256)) as llm:
        long = {p: r.generated_tokens for p, r in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}
    # greedy with ignore_eos: the short run's tokens are the long run's first ones (no second run for them)
    return SimpleNamespace(long=long, short={p: tokens[:SHORT.num_tokens_to_generate] for p, tokens in long.items()})


@pytest.fixture
async def client(fleet):
    c = InferenceClient(fleet.address, token=fleet.children.secret)
    await c.start(timeout=60)
    await c.wait_for_engines(2, timeout=300)
    await c.unpause()
    try:
        yield c
    finally:
        await c.aclose()


class Flight:
    """Requests in flight as streams: the tokens each received, and its one final request."""

    def __init__(self, client: InferenceClient, prompts: list[str], params: SamplingParams) -> None:
        self.prompts = prompts
        self.tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        self.finals: dict[int, DynamicInferenceRequest] = {}
        self.tasks = [asyncio.create_task(self._run(client, i, p, params)) for i, p in enumerate(prompts)]

    async def _run(self, client: InferenceClient, index: int, prompt: str, params: SamplingParams) -> None:
        async for item in client.add_request_streaming(prompt, params):
            if isinstance(item, StreamPartial):
                self.tokens[index] += item.new_tokens
            else:
                assert index not in self.finals, f"request {index} ended twice"
                self.finals[index] = item

    def started(self) -> set[int]:
        return {i for i, tokens in self.tokens.items() if tokens}

    async def finish(self, timeout: float) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), timeout)
        assert sorted(self.finals) == list(range(len(self.prompts)))  # none lost
        for i, final in self.finals.items():  # none duplicated: what streamed is exactly the result
            assert final.generated_tokens == self.tokens[i], i


async def test_keep_pauses_requests_in_place_and_they_complete_after_unpause(fleet, client, direct):
    before = await client.status()
    flight = Flight(client, PROMPTS[:12], GREEDY)
    engines = [e.pid for e in fleet.engines]
    await run_in_pulses(engines, lambda: len(flight.started()) >= 2, "two requests generating")
    ack = await while_held(engines, client.pause(), pending(client.status, "PAUSE"))  # the default mode
    assert ack["state"] == "PAUSED" and ack["detail"]["mode"] == "keep"
    status = await client.status()
    finished = status["completed"] - before["completed"]
    assert status["in_flight"] > 0 and status["in_flight"] + status["queued"] == 12 - finished
    assert all(e["state"] == "PAUSED" for e in status["engines"])
    held = {i: len(t) for i, t in flight.tokens.items()}
    await asyncio.sleep(1.0)  # a paused fleet generates nothing
    assert {i: len(t) for i, t in flight.tokens.items()} == held and len(flight.finals) == finished
    await client.unpause()
    await flight.finish(300)
    for i, final in flight.finals.items():
        assert (final.status, final.finish_reason) == (RequestStatus.COMPLETED, FinishReason.LENGTH)
        assert final.generated_tokens == direct.long[PROMPTS[i]], i
    after = await client.status()
    assert after["completed"] - before["completed"] == 12 and after["aborted"] == before["aborted"]


async def test_wait_finishes_running_requests_before_the_acknowledgement_and_holds_queued_ones(client, direct):
    before = await client.status()
    flight = Flight(client, PROMPTS[:12], SHORT)
    await until(lambda: len(flight.started()) >= 2, 120, "two requests generating")
    started = flight.started()
    ack = await client.pause("wait", drain_timeout=300)
    detail = ack["detail"]
    assert ack["state"] == "PAUSED"
    assert (detail["mode"], detail["unfinished"], detail["timed_out"]) == ("wait", 0, False)
    status = await client.status()
    finished = status["completed"] - before["completed"]
    assert status["in_flight"] == 0 and status["queued"] == 12 - finished  # nothing runs; the rest is held
    assert finished >= len(started)
    await until(lambda: len(flight.finals) == finished, 30, "the finished requests' results")
    assert started <= set(flight.finals)  # what ran when the verb came finished before it was acknowledged
    await asyncio.sleep(1.0)  # the held ones do not move while paused
    assert len(flight.finals) == finished and (await client.status())["queued"] == 12 - finished
    await client.unpause()
    await flight.finish(300)
    assert all(f.generated_tokens == direct.short[PROMPTS[i]] for i, f in flight.finals.items())
    assert all(f.finish_reason is FinishReason.LENGTH for f in flight.finals.values())


async def test_abort_ends_every_request_at_once_with_its_tokens_so_far_and_a_resubmission_continues_it(
        fleet, client, direct):
    before = await client.status()
    flight = Flight(client, PROMPTS, GREEDY)
    engines = [e.pid for e in fleet.engines]
    await run_in_pulses(engines, lambda: len(flight.started()) >= 2, "two requests generating")
    ack = await while_held(engines, client.pause("abort"), pending(client.status, "PAUSE"))
    detail = ack["detail"]
    status = await client.status()
    # Continued, the engines run a step or more before they read the verb (longer where they wait for a core): a
    # request may end on its own meanwhile, one of the 4 running at most. Every other one is aborted.
    finished = status["completed"] - before["completed"]
    assert finished <= 4
    assert ack["state"] == "PAUSED" and detail["mode"] == "abort" and detail["aborted"] == len(PROMPTS) - finished
    # The engines dropped their requests before they paused: nothing is left to run anywhere.
    assert all((facts["running"], facts["waiting"]) == (0, 0) for facts in detail["engines"].values())
    assert (status["in_flight"], status["queued"]) == (0, 0)
    assert status["aborted"] - before["aborted"] == len(PROMPTS) - finished and status["failed"] == before["failed"]
    await flight.finish(60)  # while the fleet is still paused
    partial = {i: f.generated_tokens for i, f in flight.finals.items() if f.finish_reason is FinishReason.ABORT}
    assert len(partial) == len(PROMPTS) - finished
    for i, final in flight.finals.items():
        if i not in partial:  # it ended on its own before the verb: whole
            assert final.generated_tokens == direct.long[PROMPTS[i]], i
            continue
        assert (final.status, final.finish_reason, final.error) == (RequestStatus.COMPLETED, FinishReason.ABORT, None)
        assert len(partial[i]) < LONG and partial[i] == direct.long[PROMPTS[i]][:len(partial[i])], i
        assert len(final.policy_epochs) == len(partial[i])
    assert all(flight.finals[i].generated_tokens for i in flight.started())  # those that ran keep their tokens
    await client.unpause()
    # The trainer's resubmission: prompt + tokens so far, for the tokens still to come.
    resubmitted = await asyncio.wait_for(asyncio.gather(*(
        client.add_request(flight.finals[i].prompt_tokens + tokens,
                           SamplingParams(temperature=0.0, num_tokens_to_generate=LONG - len(tokens), ignore_eos=True))
        for i, tokens in partial.items())), 300)
    for (i, tokens), again in zip(partial.items(), resubmitted):
        assert tokens + again.generated_tokens == direct.long[PROMPTS[i]], i


def _control(fleet, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_serve.cli", "control", *args, "--coordinator", fleet.address],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEGATRON_SERVE_TOKEN": fleet.children.secret})


async def test_control_cli_and_megatron_llm_take_a_mode_and_refuse_a_bad_one(client, fleet):
    bad = await asyncio.to_thread(_control, fleet, "pause", "--mode", "drop")
    assert bad.returncode == 2 and "--mode: invalid choice: 'drop'" in bad.stderr
    misplaced = await asyncio.to_thread(_control, fleet, "unpause", "--mode", "abort")
    assert misplaced.returncode == 1 and "--mode applies to pause only" in misplaced.stderr
    done = await asyncio.to_thread(_control, fleet, "pause", "--mode", "wait", "--drain-timeout", "5")
    assert done.returncode == 0 and "PAUSED" in done.stdout and "mode wait: waited" in done.stdout, done.stderr
    as_json = await asyncio.to_thread(_control, fleet, "pause", "--mode", "abort", "--json")
    assert json.loads(as_json.stdout)["detail"]["mode"] == "abort"
    with pytest.raises(ValueError, match="mode must be one of keep, wait, abort; got 'later'"):
        await client.pause("later")
    with pytest.raises(ValueError, match="drain_timeout applies to mode wait only"):
        await client.pause("abort", drain_timeout=3)

    from megatron_serve.api.llm import MegatronLLM

    def llm_side() -> None:
        with MegatronLLM(fleet.model, use_coordinator=True, coordinator_address=fleet.address,
                         token=fleet.children.secret) as llm:
            with pytest.raises(ValueError, match="mode must be one of"):
                llm.pause(mode="halt")
            assert llm.pause(mode="abort")["detail"]["mode"] == "abort"
            assert llm.unpause()["state"] == "RUNNING"

    await asyncio.to_thread(llm_side)
