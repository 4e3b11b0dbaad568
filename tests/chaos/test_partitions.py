"""Partitions, not crashes: an engine whose link to the coordinator goes down (packets vanish: no FIN, no RST), a
client's link to the coordinator, a trainer's during a refit, and one rank's link to the rest of its group.

The engine runs in a network namespace of its own, joined to this one by a veth pair; the coordinator, a second
engine and the client stay here. Bringing the pair down cuts the link the way a node that vanished does: the
engine is alive and keeps its sockets, and nothing it sends arrives. The coordinator must give its requests to the
other engine (each finishes with the text of an uninterrupted run, every token streamed once), and when the link
comes back the engine's late answers for requests that moved must reach no client: nothing is answered twice.

Needs root (``ip netns``); skipped with that reason elsewhere. Times to detect and to recover are printed for
docs/faults.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from megatron_serve.client.coordinator_client import InferenceClient, StreamPartial
from megatron_serve.config import InferenceConfig
from megatron_serve.wire.request import RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import Children, Recorder, free_port, until

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PROMPTS = [f"Partition test {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(24)]
LONG = SamplingParams(temperature=0.0, num_tokens_to_generate=48, ignore_eos=True)
ENGINE_ARGS = ("--num-kv-blocks", "64", "--max-requests", "8", "--drain-timeout", "1")
HEARTBEAT_TIMEOUT_S = 5
# Link-local addresses on a veth pair this test makes: they exist only between this namespace and its own.
HOST_IP, ENGINE_IP = "169.254.77.1", "169.254.77.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def engine_namespace() -> Iterator[tuple[str, str]]:
    """A network namespace joined to this one by a veth pair: ``(namespace, this side's interface)``."""
    tag = f"{os.getpid() % 100000}"
    namespace, host_side, engine_side = f"ms-part-{tag}", f"msh{tag}", f"mse{tag}"
    try:
        _ip("netns", "add", namespace)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"network namespaces cannot be made here (needs root and iproute2): {exc}")
    try:
        _ip("link", "add", host_side, "type", "veth", "peer", "name", engine_side)
        _ip("link", "set", engine_side, "netns", namespace)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", host_side)
        _ip("link", "set", host_side, "up")
        _ip("-n", namespace, "addr", "add", f"{ENGINE_IP}/30", "dev", engine_side)
        _ip("-n", namespace, "link", "set", engine_side, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        yield namespace, host_side, engine_side
    finally:
        subprocess.run(["ip", "link", "del", host_side], capture_output=True)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


@pytest.fixture(scope="module")
def direct(tiny_model):
    from megatron_serve.api.llm import MegatronLLM  # noqa: PLC0415

    llm = MegatronLLM(tiny_model, InferenceConfig(num_kv_blocks=64))
    try:
        return {p: r.generated_text for p, r in zip(PROMPTS, llm.generate(PROMPTS, LONG))}
    finally:
        llm.close()


async def test_an_engine_cut_off_mid_stream_loses_no_request_and_answers_none_twice(tiny_model, direct, tmp_path):
    children = Children(tmp_path)
    port = free_port()
    with engine_namespace() as (namespace, host_side, _):
        try:
            children.spawn(["coordinator", "--model", tiny_model, "--host", "0.0.0.0", "--port", str(port),
                            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)], "coordinator")
            children.engine(tiny_model, port, *ENGINE_ARGS)
            cut_off = _engine_in(children, namespace, tiny_model, port)
            await _cut_and_report(port, children, cut_off.pid, host_side, direct, "coordinator-engine",
                                  f"heartbeat timeout {HEARTBEAT_TIMEOUT_S}s", coordinator_timeout=3.0)
        finally:
            children.kill_all()


async def _stream_text(client: InferenceClient, prompt: str, streamed: dict[str, str]):
    """Stream ``prompt`` (its id: the prompt), adding each piece of text to ``streamed[prompt]``; its final result."""
    async for item in client.add_request_streaming(prompt, LONG, request_id=prompt):
        if isinstance(item, StreamPartial):
            streamed[prompt] += item.new_text
        else:
            return item


async def _cut_under_streams(client: InferenceClient, pid: int, host_side: str, direct: dict[str, str]
                             ) -> tuple[float, float]:
    """Stream every prompt, bring the pair down once the engine ``pid`` leads holds requests while tokens flow, and
    check what a cut must leave: the engine dropped, each request moved and completed with ``direct``'s text,
    streamed once; then bring the pair up, wait for the engine to register again, and check that the late answers
    reached no client. Returns the seconds from the cut to the engine's removal and to every request's end."""
    recorder = Recorder(client)
    streamed = dict.fromkeys(PROMPTS, "")
    tasks = [asyncio.create_task(_stream_text(client, p, streamed)) for p in PROMPTS]
    victim = await _busy(client, pid, streamed)
    _ip("link", "set", host_side, "down")  # packets vanish both ways
    cut = time.monotonic()
    while victim in {e["id"] for e in (await client.status())["engines"]}:
        await asyncio.sleep(0.1)
    detected = time.monotonic() - cut
    results = await asyncio.wait_for(asyncio.gather(*tasks), 300)
    recovered = time.monotonic() - cut
    assert all(r.status is RequestStatus.COMPLETED for r in results), [r.status for r in results]
    for prompt, result in zip(PROMPTS, results):
        assert result.generated_text == direct[prompt] == streamed[prompt], prompt
    assert any(any(e.type.value == "EVICT" for e in r.events) for r in results), "no request moved"
    _ip("link", "set", host_side, "up")  # the engine's queued frames now arrive: late answers
    await client.wait_for_engines(2, timeout=120)  # it registers again, as a new engine
    again = await asyncio.wait_for(asyncio.gather(*(client.add_request(p, LONG) for p in PROMPTS)), 300)
    assert [r.generated_text for r in again] == [direct[p] for p in PROMPTS]
    assert all(recorder.results[p] == 1 for p in PROMPTS), recorder.results
    return detected, recovered


async def _cut_and_report(port: int, children: Children, pid: int, host_side: str, direct: dict[str, str],
                          what: str, limit: str, **client_options: float) -> None:
    """:func:`_cut_under_streams` through a client of the coordinator on ``port`` once both engines registered, and
    its times printed for partition ``what`` beside the ``limit`` that detects it."""
    client = InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret, **client_options)
    await client.start(timeout=60)
    await client.wait_for_engines(2, timeout=300)
    detected, recovered = await _cut_under_streams(client, pid, host_side, direct)
    print(f"\npartition {what}: detected in {detected:.1f}s, every request done {recovered:.1f}s after the cut "
          f"({limit})")
    client.close()


def _in_namespace(children: Children, namespace: str, name: str, *args: str, env: dict[str, str] | None = None
                  ) -> subprocess.Popen:
    """``megatron-serve ARGS`` inside ``namespace`` (``ip netns exec`` execs it: the pid is the command's)."""
    log = children.log_dir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-m", "megatron_serve.cli", *args],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "MEGATRON_SERVE_TOKEN": children.secret, **(env or {})})
    children.procs.append((proc, log))
    return proc


def _engine_in(children: Children, namespace: str, model: str, port: int) -> subprocess.Popen:
    """An engine inside ``namespace``, reaching the coordinator over the veth pair."""
    return _in_namespace(children, namespace, "engine-cut-off", "engine", "--model", model, "--coordinator",
                         f"tcp://{HOST_IP}:{port}", *ENGINE_ARGS)


async def test_a_client_cut_off_from_its_coordinator_finishes_or_fails_naming_it(tiny_model, direct, tmp_path):
    """The link between a client (a server's, here the test's) and the coordinator goes down: back within the
    client's grace period every stream finishes with its whole text, each token once; down for longer, each request
    in flight fails within grace + time-out with ``CoordinatorLost`` naming the cause, and none waits forever. Both
    cuts on one coordinator and engine (the short one first: it leaves them as they were), a client each."""
    children = Children(tmp_path)
    port = free_port()
    with engine_namespace() as (namespace, host_side, _):
        try:
            _in_namespace(children, namespace, "coordinator", "coordinator", "--model", tiny_model, "--host",
                          ENGINE_IP, "--port", str(port))
            _in_namespace(children, namespace, "engine", "engine", "--model", tiny_model, "--coordinator",
                          f"tcp://{ENGINE_IP}:{port}", *ENGINE_ARGS)
            await _cut_a_client(children, port, host_side, direct, PROMPTS[:8], 2.0, "completed")
            await _cut_a_client(children, port, host_side, direct, PROMPTS[8:16], 8.0, "lost")
        finally:
            children.kill_all()


async def _cut_a_client(children: Children, port: int, host_side: str, direct: dict[str, str], prompts: list[str],
                        cut_s: float, outcome: str) -> None:
    """Stream ``prompts`` through a client of its own, bring the pair down for ``cut_s`` once tokens flow, and check
    the ``outcome`` (``completed``: every stream whole; ``lost``: each unfinished one failed naming the coordinator)."""
    from megatron_serve.client.coordinator_client import CoordinatorLost  # noqa: PLC0415

    grace, timeout = 4.0, 1.0
    client = InferenceClient(f"tcp://{ENGINE_IP}:{port}", token=children.secret, coordinator_timeout=timeout,
                             coordinator_grace=grace)
    await client.start(timeout=60)
    await client.wait_for_engines(1, timeout=300)
    streamed = dict.fromkeys(prompts, "")
    tasks = [asyncio.create_task(_stream_text(client, p, streamed)) for p in streamed]
    while sum(map(len, streamed.values())) < 20:
        await asyncio.sleep(0.02)
    _ip("link", "set", host_side, "down")
    cut = time.monotonic()
    ends: list[float] = []
    for task in tasks:
        task.add_done_callback(lambda _: ends.append(time.monotonic() - cut))
    done, _ = await asyncio.wait(tasks, timeout=cut_s)  # what ends while the link is down
    _ip("link", "set", host_side, "up")
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 300)
    ended = max(ends)
    # a short cut ends nothing before the link is back; a long one ends everything before it is
    assert len(done) == (0 if outcome == "completed" else len(tasks)), (cut_s, len(done), ends)
    if outcome == "completed":
        for prompt, result in zip(streamed, outcomes):
            assert not isinstance(result, BaseException), result
            assert result.generated_text == direct[prompt] == streamed[prompt], prompt
    else:
        unfinished = [o for o in outcomes if isinstance(o, BaseException)]
        assert unfinished and all(isinstance(o, CoordinatorLost) for o in unfinished), outcomes
        assert all("coordinator" in str(o) for o in unfinished)
        assert all(o.generated_text == direct[p] for p, o in zip(streamed, outcomes)
                   if not isinstance(o, BaseException))
    print(f"\npartition client-coordinator, {cut_s:g}s cut: {outcome}, every request ended {ended:.1f}s after "
          f"the cut (grace {grace:g}s, coordinator time-out {timeout:g}s)")
    client.close()


async def _busy(client: InferenceClient, pid: int, streamed: dict[str, str], timeout: float = 120) -> str:
    """The cut-off engine's id once it holds requests and tokens flow: the moment to cut it off."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = await client.status()
        mine = [e for e in status["engines"] if int(e["info"]["pid"]) == pid]
        if mine and mine[0]["assigned"] > 0 and sum(map(len, streamed.values())) >= 40:
            return mine[0]["id"]
        await asyncio.sleep(0.02)
    raise AssertionError("the cut-off engine never held requests while tokens flowed")


TRAINER = Path(__file__).parents[1] / "weights" / "trainer.py"
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)
TRANSFER_TIMEOUT_S = 15


@pytest.fixture(scope="module")
def policy_b(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """Another tiny model (the trainer's new weights) and its greedy tokens for PROMPTS, from a direct engine."""
    from megatron_serve.api.llm import MegatronLLM  # noqa: PLC0415
    from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415

    model = str(make_tiny_model(tmp_path_factory.mktemp("policy-b"), seed=1))
    with MegatronLLM(model, InferenceConfig(num_kv_blocks=64)) as llm:
        return model, [r.generated_tokens for r in llm.generate(PROMPTS, GREEDY)]


def _trainer_in(children: Children, namespace: str, port: int, model: str, epoch: int, *extra: str
                ) -> subprocess.Popen:
    """tests/weights/trainer.py inside ``namespace``: it reaches the coordinator over the veth pair and serves the
    transfer's store on its own side of it; its JSON lines on a pipe."""
    return subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, str(TRAINER), f"tcp://{HOST_IP}:{port}",
                             model, str(epoch), str(64 << 10), "--timeout", str(TRANSFER_TIMEOUT_S), *extra],
                            stdout=subprocess.PIPE, stderr=open(children.log_dir / f"trainer-{epoch}.log", "wb"),
                            stdin=subprocess.DEVNULL, text=True,
                            env={**os.environ, "MEGATRON_SERVE_TOKEN": children.secret})


async def _line(proc: subprocess.Popen, timeout: float = 300) -> dict:
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout)
    assert line, f"the trainer ended without a line (exit {proc.wait()})"
    return json.loads(line)


async def _greedy(client: InferenceClient) -> tuple[list[list[int]], set[int]]:
    results = await asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS))
    return [r.generated_tokens for r in results], {e for r in results for e in r.policy_epochs}


async def test_a_trainer_cut_off_mid_refit_leaves_every_engine_on_its_old_weights(tiny_model, policy_b, tmp_path):
    """The trainer's link (to the coordinator and to every engine rank) goes down after two buckets of a refit:
    the engines' transfer times out, nothing is applied (they load only once every rank committed), every engine
    stays on its old weights and epoch and serves them again once unpaused; a trainer on a link that works then
    refits the fleet. The time from the cut to the REFIT's answer is printed for docs/faults.md."""
    children = Children(tmp_path)
    port = free_port()
    model_b, tokens_b = policy_b
    with engine_namespace() as (namespace, host_side, _):
        try:
            children.spawn(["coordinator", "--model", tiny_model, "--host", "0.0.0.0", "--port", str(port)],
                           "coordinator")
            children.engine(tiny_model, port)
            children.engine(tiny_model, port)
            async with InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret) as client:
                await client.wait_for_engines(2, timeout=300)
                tokens_a, epochs = await _greedy(client)
                assert epochs == {0} and tokens_a != tokens_b
                await client.pause()
                held = _trainer_in(children, namespace, port, model_b, 3, "--hold-after-bucket", "2")
                try:
                    first = await _line(held)
                    while first.get("bucket") != 2:
                        first = await _line(held)
                    _ip("link", "set", host_side, "down")
                    cut = time.monotonic()

                    async def answered():
                        status = await client.status()
                        return status if not status["pending_controls"] else None

                    status = await until(answered, TRANSFER_TIMEOUT_S + 90, "the cut REFIT to be answered")
                    answered_s = time.monotonic() - cut
                    assert not status["incomplete_weights"]
                    assert status["epoch"] == 0 and all(e["epoch"] == 0 for e in status["engines"]), status
                    await client.unpause()
                    assert await _greedy(client) == (tokens_a, {0})
                finally:
                    held.kill()
                    held.wait()
                _ip("link", "set", host_side, "up")
                await client.pause()
                trainer = _trainer_in(children, namespace, port, model_b, 5)
                ack = await _line(trainer)
                while "bucket" in ack:
                    ack = await _line(trainer)
                assert trainer.wait(60) == 0 and ack["detail"]["epoch"] == 5, ack
                await client.unpause()
                assert await _greedy(client) == (tokens_b, {5})
            print(f"\npartition trainer-engine during a refit: answered {answered_s:.1f}s after the cut (transfer "
                  f"time-out {TRANSFER_TIMEOUT_S}s), every engine on its old epoch")
        finally:
            children.kill_all()


async def test_a_rank_cut_off_from_its_group_moves_the_groups_requests_and_answers_none_twice(tiny_model, tmp_path):
    """Group A is two tensor-parallel ranks: rank 0 here, rank 1 in the namespace, their collectives over the veth
    pair (as two pods of a LeaderWorkerSet); group B is one rank here. With the pair down, A's step waits in a
    collective that never completes: its leader still hears the coordinator and heartbeats, but its step loop makes
    no progress, and the coordinator's stall check takes its requests to B. Every stream completes with the text
    of an uninterrupted run (``--batch-invariant``: two ranks' tokens are one rank's), each answered once; with the
    pair back up, A's step completes and its late answers for requests that moved reach no client."""
    from megatron_serve.api.llm import MegatronLLM  # noqa: PLC0415

    invariant = ("--batch-invariant",)
    with MegatronLLM(tiny_model, InferenceConfig(num_kv_blocks=64, batch_invariant=True)) as llm:
        direct = {p: r.generated_text for p, r in zip(PROMPTS, llm.generate(PROMPTS, LONG))}
    children = Children(tmp_path)
    port, stall_s = free_port(), 4.0
    with engine_namespace() as (namespace, host_side, engine_side):
        try:
            children.spawn(["coordinator", "--model", tiny_model, "--host", "0.0.0.0", "--port", str(port),
                            "--stall-timeout", str(stall_s)], "coordinator")
            children.engine(tiny_model, port, *ENGINE_ARGS, *invariant)
            rendezvous = {"WORLD_SIZE": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": HOST_IP,
                          "MASTER_PORT": str(free_port())}
            leader = children.engine(tiny_model, port, *ENGINE_ARGS, *invariant, "--tensor-parallel", "2",
                                     env={**rendezvous, "RANK": "0", "GLOO_SOCKET_IFNAME": host_side})
            _in_namespace(children, namespace, "rank-cut-off", "engine", "--model", tiny_model, "--coordinator",
                          f"tcp://{HOST_IP}:{port}", *ENGINE_ARGS, *invariant, "--tensor-parallel", "2",
                          env={**rendezvous, "RANK": "1", "GLOO_SOCKET_IFNAME": engine_side})
            await _cut_and_report(port, children, leader.pid, host_side, direct, "rank-rank (tensor-parallel group)",
                                  f"stall time-out {stall_s:g}s")
        finally:
            children.kill_all()
