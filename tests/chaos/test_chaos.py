"""Chaos: random kills and stops of engines and the coordinator, and random verbs, while 100 requests stream.

``megatron-serve run --engines 2`` (supervised: what is killed comes back). A seeded schedule
(``MEGATRON_CHAOS_SEED``, default below) hurts the fleet every 1.5-4 s for ``MEGATRON_CHAOS_SECONDS``
(default 30: about ten faults and verbs, each kind more than once; every engine or coordinator killed costs
seconds of CPU to start again, so a longer default buys repetitions, not new cases): SIGKILL of an engine or of the coordinator, SIGSTOP of either for a few seconds, and
the verbs PAUSE/UNPAUSE and SUSPEND/RESUME/UNPAUSE through a client of its own. Meanwhile 100
requests with seeded lengths and start times (spread over the chaos) stream, at most 25 at a time,
through a client of the coordinator. Then the
fleet is left alone and every request must end by a deadline: completed with exactly the greedy
token ids of a quiet run (each token once), or failed with an error that says what happened;
none twice, none hung. The counts are printed (``-s``) for the record.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import time

import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.wire.sampling_params import SamplingParams
from tests.run_stack import RunStack, alive, client_stream, start_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SEED = int(os.environ.get("MEGATRON_CHAOS_SEED", "31"))
CHAOS_SECONDS = float(os.environ.get("MEGATRON_CHAOS_SECONDS", "30"))
REQUESTS = 100
AT_ONCE = 25
LONGEST = 96
#: After the chaos stops, every request must have ended within this many seconds (a killed engine takes
#: tens of seconds to load again on a loaded 2-core host).
SETTLE_SECONDS = 240.0


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    stack = start_run(tiny_model, tmp_path_factory.mktemp("chaos"), "--drain-timeout", "5")
    try:
        yield stack
    finally:
        stack.kill()


class Chaos:
    """The seeded schedule of faults and verbs, and what it did."""

    def __init__(self, stack: RunStack, client: InferenceClient, rng: random.Random) -> None:
        self.stack, self.client, self.rng = stack, client, rng
        self.done: collections.Counter[str] = collections.Counter()
        self.verb_errors: list[str] = []
        self.stopped: set[int] = set()
        self.tasks: list[asyncio.Task] = []

    async def run(self, until: float) -> None:
        actions = [self.kill_engine, self.kill_coordinator, self.stop_engine, self.stop_coordinator, self.pause,
                   self.suspend]
        weights = [3, 1, 2, 1, 2, 1]
        while time.monotonic() < until:
            await asyncio.sleep(self.rng.uniform(1.5, 4.0))
            action = self.rng.choices(actions, weights)[0]
            self.tasks.append(asyncio.create_task(action()))
        await asyncio.gather(*self.tasks)

    def _pick(self, role: str) -> int | None:
        pids = sorted(pid for pid in self.stack.children()[role] if pid not in self.stopped)
        return self.rng.choice(pids) if pids else None

    async def kill_engine(self) -> None:
        await self._kill("engine")

    async def kill_coordinator(self) -> None:
        await self._kill("coordinator")

    async def _kill(self, role: str) -> None:
        pid = self._pick(role)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            self.done[f"SIGKILL {role}"] += 1

    async def stop_engine(self) -> None:
        await self._stop("engine", self.rng.uniform(2.0, 12.0))

    async def stop_coordinator(self) -> None:
        await self._stop("coordinator", self.rng.uniform(1.0, 4.0))

    async def _stop(self, role: str, seconds: float) -> None:
        pid = self._pick(role)
        if pid is None:
            return
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(pid)
        self.done[f"SIGSTOP {role}"] += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
            self.stopped.discard(pid)

    async def pause(self) -> None:
        await self._verbs("PAUSE", [self.client.pause, self.client.unpause])

    async def suspend(self) -> None:
        await self._verbs("SUSPEND", [self.client.suspend, self.client.resume, self.client.unpause])

    async def _verbs(self, name: str, verbs: list) -> None:
        self.done[name] += 1
        for verb in verbs:
            try:
                await verb(timeout=30)
            except Exception as exc:  # noqa: BLE001 - refused or lost in the chaos: noted, the next one goes on
                self.verb_errors.append(f"{verb.__name__}: {type(exc).__name__}: {exc}")
            await asyncio.sleep(self.rng.uniform(0.2, 2.0))


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length when one is the other's start)."""
    for index, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return index
    return None if len(got) == len(want) else min(len(got), len(want))


async def settle(client: InferenceClient) -> None:
    """Bring the fleet back to RUNNING, whatever the last verbs left (a coordinator may have restarted)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            state = (await client.status(timeout=10))["state"]
            if state == "RUNNING":
                return
            await (client.resume if state == "SUSPENDED" else client.unpause)(timeout=30)
        except Exception:  # noqa: BLE001 - a coordinator coming back: ask again
            pass
        assert time.monotonic() < deadline, "the fleet did not come back to RUNNING"
        await asyncio.sleep(0.5)


async def test_chaos(stack):
    rng = random.Random(SEED)
    prompts = [f"Chaos {i}: {' '.join(rng.choice(['red', 'fox', 'sky', 'river', 'stone']) for _ in range(6))}"
               for i in range(REQUESTS)]
    lengths = [rng.randint(16, LONGEST) for _ in range(REQUESTS)]
    starts = sorted(rng.uniform(0, CHAOS_SECONDS * 0.8) for _ in range(REQUESTS))  # spread over the chaos
    async with InferenceClient(stack.coordinator(), stack.secret(), coordinator_timeout=3.0) as client:
        # each prompt's quiet run as long as its chaotic one (what the comparison reads), not LONGEST for all
        quiet = await asyncio.gather(*(client.add_request(p, SamplingParams(
            temperature=0.0, num_tokens_to_generate=n, ignore_eos=True)) for p, n in zip(prompts, lengths)))
        greedy = {p: r.generated_tokens for p, r in zip(prompts, quiet)}

    async with InferenceClient(stack.coordinator(), stack.secret(), coordinator_timeout=3.0) as client, \
            InferenceClient(stack.coordinator(), stack.secret(), coordinator_timeout=3.0, role="control") as verbs:
        slots = asyncio.Semaphore(AT_ONCE)

        async def one(prompt: str, length: int, start: float):
            await asyncio.sleep(start)
            async with slots:
                return await client_stream(client, prompt, length)

        began = time.monotonic()
        requests = [asyncio.create_task(one(p, n, t)) for p, n, t in zip(prompts, lengths, starts)]
        chaos = Chaos(stack, verbs, rng)
        await chaos.run(until=began + CHAOS_SECONDS)
        calm = time.monotonic()
        await settle(verbs)
        done, hung = await asyncio.wait(requests, timeout=SETTLE_SECONDS)
        for task in hung:
            task.cancel()
        settled = time.monotonic() - calm

    outcomes = [task.result() for task in requests if task in done]
    completed = [o for o in outcomes if o.completed]
    failed = [o for o in outcomes if not o.completed]
    reasons = collections.Counter(f"{type(o.error).__name__}: {getattr(o.error, 'code', '')}" if o.error
                                  else f"{o.final.status.name} {o.final.finish_reason}" for o in failed)
    print(f"\nchaos (seed {SEED}, {CHAOS_SECONDS:g}s): {dict(chaos.done)}; verbs refused or lost: "
          f"{len(chaos.verb_errors)}\n{REQUESTS} requests: {len(completed)} completed with the quiet run's tokens, "
          f"{len(failed)} failed with an error {dict(reasons)}, {len(hung)} hung; all ended {settled:.0f}s after "
          f"the chaos; restarts in the run's log: {stack.output().count(' died (')}")
    assert not hung, f"{len(hung)} request(s) did not end within {SETTLE_SECONDS:g}s of the chaos"
    assert sum(chaos.done.values()) >= CHAOS_SECONDS / 4 * 0.5  # the schedule really ran
    for prompt, length, outcome in zip(prompts, lengths, outcomes):
        if outcome.completed:
            expected = greedy[prompt][:length]
            assert outcome.tokens == outcome.final.generated_tokens == expected, (
                f"{prompt!r} (max_tokens {length}): streamed {len(outcome.tokens)} {outcome.tokens}; final record "
                f"{len(outcome.final.generated_tokens)} {outcome.final.generated_tokens}; quiet run "
                f"{len(expected)} {expected}; first difference streamed/quiet at "
                f"{first_difference(outcome.tokens, expected)}, final/quiet at "
                f"{first_difference(outcome.final.generated_tokens, expected)}")
        else:  # a clear error: it says what happened
            final = outcome.final
            assert outcome.error is not None and str(outcome.error) or final is not None and final.error, prompt
            assert len(outcome.tokens) <= length, prompt  # nothing twice, even on the way to an error
    assert stack.proc.poll() is None, "the run went down"
