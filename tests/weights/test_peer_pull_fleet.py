"""Late joiners pull the fleet's weights from a live peer (issue 50, build item 5), real processes, gloo on CPU.

A coordinator and an engine started from checkpoint A; this test process is the trainer and refits the fleet
to B (epoch 1), which exists nowhere the engines could read. An engine started afterwards from A pulls epoch 1
from the live engine (weights.peer_pull): alone (its peer killed), it serves B's tokens (==, against a server
of B) with epoch 1 on every token and in STATUS. The killed engine, restarted from A, pulls from the one that
joined and serves B alone too. Control: with no live engine left to pull from, an engine started from A
holds A (epoch 0, what it read from disk), and the fleet gives it no requests.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from megatron_serve import WeightSender
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.fleet.launcher_client import Launcher
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.wire.sampling_params import SamplingParams

from ..devices import tensor_parallel_device
from ..helpers import Children, free_port, greedy_tokens, shared_launcher
from .fleet_dump import dump_fleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "1 2 3 4", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)


def outputs(model_dir: str) -> list[list[int]]:
    return greedy_tokens(model_dir, PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("peer-pull")
    a, b = str(make_tiny_model(root / "a", seed=0)), str(make_tiny_model(root / "b", seed=1))
    expected = SimpleNamespace(a=outputs(a), b=outputs(b))
    assert expected.a != expected.b, "control: A's tokens are not B's"
    return SimpleNamespace(a=a, b=b, expected=expected)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory) -> Iterator[Launcher]:
    """One engine launcher for the fleets of this module's tests: each launcher's start imports torch again."""
    with shared_launcher(tmp_path_factory.mktemp("peer-pull-launcher")) as launcher:
        yield launcher


async def engines_until(client: InferenceClient, check, timeout: float = 300.0) -> list[dict]:
    """Poll STATUS until ``check(engines)`` holds; returns the engines."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        engines = (await client.status())["engines"]
        if check(engines):
            return engines
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"STATUS engines never became what the test waits for: {engines}")
        await asyncio.sleep(0.1)


def serving(count: int):
    """STATUS says ``count`` engines serve epoch 1, each done registering (pulling included: its heartbeats count
    its step loop's iterations only from then on)."""
    return lambda engines: len(engines) == count and all(e["epoch"] == 1 and e["progress"] is not None
                                                         for e in engines)


async def kill(proc: subprocess.Popen, client: InferenceClient, left: int) -> None:
    """SIGKILL an engine process, then wait until the coordinator lists ``left`` engines."""
    proc.send_signal(signal.SIGKILL)
    await asyncio.to_thread(proc.wait, 60)
    await engines_until(client, lambda engines: len(engines) == left, 60)


async def served_alone(client: InferenceClient, children: Children, log_dir: Path) -> list:
    """The prompts' answers, within 120 s; when they take over 30 s the fleet's stacks, STATUS and logs are printed
    (a hang seen once under load is then read from the failure's output)."""
    answers = asyncio.ensure_future(asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS)))
    try:
        return await asyncio.wait_for(asyncio.shield(answers), 30)
    except TimeoutError:
        await dump_fleet(children, client, log_dir)
    return await asyncio.wait_for(answers, 90)


async def test_engines_that_join_after_a_trainer_refit_pull_it_from_a_peer(models, launcher, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    children = Children(logs, launcher=launcher)
    port = free_port()
    try:
        children.coordinator(models.a, port, "--heartbeat-timeout", "3")
        first = children.engine(models.a, port, "--group", "0")
        async with InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret) as client:
            await client.wait_for_engines(1, timeout=300)
            await client.pause()
            policy = sorted(load_file(str(Path(models.b) / "model.safetensors")).items())
            ack = await asyncio.wait_for(WeightSender(client, backend="gloo", timeout=60).send(policy, epoch=1), 120)
            assert ack["detail"]["epoch"] == 1
            await client.unpause()
            assert [r.generated_tokens for r in await served_alone(client, children, logs)] == models.expected.b

            # a new engine joins: it pulls epoch 1 from the first, then serves alone
            joiner = children.engine(models.a, port, "--group", "1")
            await engines_until(client, serving(2))
            await kill(first, client, left=1)
            outs = await served_alone(client, children, logs)
            assert [r.generated_tokens for r in outs] == models.expected.b
            assert all(set(r.policy_epochs) == {1} for r in outs)

            # the killed engine restarts from A: it pulls from the joiner, then serves alone
            children.engine(models.a, port, "--group", "0")
            engines = await engines_until(client, serving(2))
            assert len({e["weights"] for e in engines}) == 1  # the trainer's, as the fleet's
            await kill(joiner, client, left=1)
            status = await client.status()
            assert status["epoch"] == 1 and [e["epoch"] for e in status["engines"]] == [1]
            outs = await served_alone(client, children, logs)
            assert [r.generated_tokens for r in outs] == models.expected.b
            assert all(set(r.policy_epochs) == {1} for r in outs)

            # control: nobody left to pull from, so an engine started from A holds A (epoch 0) and gets no requests
            await kill(children.procs[-1][0], client, left=0)
            children.engine(models.a, port, "--group", "2")
            engines = await engines_until(client, lambda es: len(es) == 1)
            assert [(e["epoch"], e["weights"]) for e in engines] == [(0, models.a)]
            assert (await client.status())["epoch_mismatch"] == [engines[0]["id"]]
    finally:
        children.kill_all()


async def test_groups_pull_rank_to_rank_from_a_group_of_their_layout(models, launcher, tmp_path):
    """A tensor-parallel 2 and a pipeline-parallel 2 group serve A; the trainer refits them to B (epoch 1). A group of
    each layout joins: each of its ranks pulls from the same rank of the live group of its layout (the tensor-parallel
    ranks their slices, the stages their layers), all pairs at once. With the live groups killed, the joiners alone
    serve B's tokens (==), epoch 1 on every token, both of them."""
    logs = tmp_path / "logs"
    logs.mkdir()
    children = Children(logs, launcher=launcher)
    port = free_port()
    pair = ("--device", tensor_parallel_device(2))  # a machine with one GPU runs the two-rank groups on CPU
    layouts = (("--tensor-parallel", "2", *pair), ("--pipeline-parallel-size", "2", *pair))
    try:
        children.coordinator(models.a, port, "--heartbeat-timeout", "60", "--routing", "round_robin")
        donors = [children.engine(models.a, port, "--group", str(group), *flags) for group, flags in enumerate(layouts)]
        async with InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret) as client:
            await engines_until(client, lambda es: len(es) == 2 and all(e["progress"] is not None for e in es))
            await client.pause()
            policy = sorted(load_file(str(Path(models.b) / "model.safetensors")).items())
            ack = await asyncio.wait_for(WeightSender(client, backend="gloo", timeout=60).send(policy, epoch=1), 120)
            assert ack["detail"]["epoch"] == 1 and ack["detail"]["sender"]["world_size"] == 5
            await client.unpause()

            for group, flags in enumerate(layouts, start=2):  # the joiners: one of each layout
                children.engine(models.a, port, "--group", str(group), *flags)
            engines = await engines_until(client, serving(4))
            assert all(e["weights"] == engines[0]["weights"] for e in engines)
            for donor in donors:
                await kill(donor, client, left=4 - donors.index(donor) - 1)
            status = await client.status()
            assert sorted(e["group"] for e in status["engines"]) == [2, 3]
            # round robin: both joiners serve
            outs = [*await served_alone(client, children, logs), *await served_alone(client, children, logs)]
            assert [r.generated_tokens for r in outs] == models.expected.b * 2
            assert all(set(r.policy_epochs) == {1} for r in outs)
            counted = {e["group"]: ((e["metrics"] or {}).get("counters") or {}).get("generation_tokens", 0)
                       for e in (await engines_until(client, lambda es: sum(
                           ((e["metrics"] or {}).get("counters") or {}).get("generation_tokens", 0)
                           for e in es) >= len(outs) * 8))}
            assert all(counted[group] > 0 for group in (2, 3)), counted
    finally:
        children.kill_all()
