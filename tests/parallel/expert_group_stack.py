"""A tiny Qwen3-MoE over expert parallelism 4 with data-parallel attention, one engine process per rank over gloo,
under ``--batch-invariant`` (a token's result depends neither on the rank count nor on where its experts run), with a
coordinator and a client: the stack of the tests of a rank's loss and of resizing the group, each of which compares
streams with the uninterrupted ones it starts with."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_serve.model.tiny import make_tiny_model
from tests.run_stack import Streamed, client_stream

from ..helpers import Children, free_port, run_in_pulses, signal_processes
from ..model.test_moe import VARIANTS

RANKS = 4
#: The rank the loss tests kill: not rank 0, whose engine hosts the rendezvous store (its loss ends the group).
KILLED = 2
#: The longest pulse of :meth:`ExpertGroup.in_flight` (they double from 1 ms): a step is a collective of every rank,
#: which must all run at once, and on two cores 1 ms pulses, each followed by the settling wait, took minutes to
#: reach the first tokens (the resize file 685 s, a rank reported stalled meanwhile; 37 s with this).
PULSE_S = 0.032
PROMPTS = [f"Request {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(8)]


@dataclass
class ExpertGroup:
    """The stack (see the module docstring): ``engines[d]`` is data-parallel rank ``d``'s first engine process,
    ``quiet`` each prompt's stream before anything happened to the group, ``extra`` more options of every engine."""

    children: Children
    model_dir: str
    port: int
    tokens: int
    client: Any = None
    extra: tuple[str, ...] = ()
    ranks: int = RANKS
    rendezvous: dict[str, str] = field(default_factory=dict)
    engines: list[subprocess.Popen] = field(default_factory=list)
    quiet: list[Streamed] = field(default_factory=list)

    def engine(self, rank: int) -> subprocess.Popen:
        """Data-parallel rank ``rank``'s engine, at the group's rendezvous (a restart joins the running group)."""
        return self.children.engine(self.model_dir, self.port, "--dtype", "float32", "--batch-invariant",
                                    "--data-parallel-size", str(self.ranks), "--data-parallel-rank", str(rank),
                                    "--enable-expert-parallel", *self.extra, env=self.rendezvous)

    async def in_flight(self, held: bool = False) -> list[asyncio.Task]:
        """Every prompt streaming, each past its first token: the engines run in pulses until then
        (:func:`~tests.helpers.run_in_pulses`), so that none ran on to the streams' end meanwhile. ``held``: they are
        left stopped (SIGSTOP), for the caller to continue, else they continue now."""
        firsts = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.create_task(client_stream(self.client, p, self.tokens, first))
                 for p, first in zip(PROMPTS, firsts)]
        pids = [engine.pid for engine in self.engines]
        await run_in_pulses(pids, lambda: all(f.is_set() for f in firsts), "every stream's first token",
                            longest_pulse_s=PULSE_S, timeout=300)
        if not held:
            signal_processes(pids, signal.SIGCONT)
        assert not any(task.done() for task in tasks), "the streams ended before anything happened: nothing is tested"
        return tasks

    async def completed(self, tasks: list[asyncio.Task]) -> None:
        """``tasks`` (:meth:`in_flight`) end with the uninterrupted streams' tokens."""
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 600)
        assert [o.tokens for o in outcomes] == [q.tokens for q in self.quiet], [o.error for o in outcomes]

    async def kill_mid_stream(self, rank: int) -> list[subprocess.Popen]:
        """Rank ``rank``'s engine SIGKILLed with every prompt streaming: every stream ends with the uninterrupted
        tokens, and the other ranks' engines serve on in their own processes, regrouped (returned, in rank order)."""
        tasks = await self.in_flight(held=True)
        survivors = [engine for d, engine in enumerate(self.engines) if d != rank]
        pids = [engine.pid for engine in survivors]
        said = [len(self.children.log_of(engine)) for engine in survivors]  # a regroup before this kill does not count
        self.engines[rank].kill()
        signal_processes(pids, signal.SIGCONT)  # the streams still in flight: none ran on while they were stopped
        await self.completed(tasks)
        assert [engine.pid for engine in survivors if engine.poll() is None] == pids  # none restarted, none gone
        for d, engine, since in zip([d for d in range(self.ranks) if d != rank], survivors, said):
            log = self.children.log_of(engine)[since:]
            assert f"expert-parallel rank {d} is rank" in log, log[-3000:]
        return survivors

    async def served_by_each(self) -> dict[str, int]:
        """Every prompt streamed again, with the uninterrupted tokens; how many each engine completed meanwhile."""
        before = await self._completed_by_engine()
        streams = await asyncio.gather(*(client_stream(self.client, p, self.tokens) for p in PROMPTS))
        assert [s.tokens for s in streams] == [q.tokens for q in self.quiet], [s.error for s in streams]
        return {engine: done - before.get(engine, 0) for engine, done in (await self._completed_by_engine()).items()}

    async def rejoin(self, rank: int) -> subprocess.Popen:
        """Lost rank ``rank`` restarted (the same command, the same rendezvous): it joins the running group as rank
        ``rank`` of all of them, and every engine serves again (:meth:`served_by_each`). Returns its engine."""
        joiner = self.engine(rank)
        await self.logged(joiner, f"expert-parallel rank {rank} is rank {rank} of {self.ranks}", 120)
        await self.client.wait_for_engines(self.ranks, timeout=60)
        served = await self.served_by_each()
        assert len(served) == self.ranks and all(served.values()), served
        return joiner

    async def _completed_by_engine(self) -> dict[str, int]:
        return {engine["id"]: engine["completed"] for engine in (await self.client.status())["engines"]}

    async def logged(self, proc: subprocess.Popen, text: str, timeout: float, since: int = 0) -> None:
        """Poll ``proc``'s log until it says ``text`` (past its first ``since`` characters: what it said before does
        not count); fails at once when ``proc`` exits. Awaited: the client's connection runs on the same event loop
        and must keep answering meanwhile."""
        deadline = time.monotonic() + timeout
        while text not in self.children.log_of(proc)[since:]:
            assert proc.poll() is None and time.monotonic() < deadline, self.children.log_of(proc)[-3000:]
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def expert_group(tmp_path: Path, tokens: int, model_dir: str | None = None, extra: tuple[str, ...] = (),
                       ranks: int = RANKS, own_store: bool = False) -> AsyncIterator[ExpertGroup]:
    """The stack started and its uninterrupted streams taken (``tokens`` each); every process killed after.
    ``model_dir``: the model (the tiny Qwen3-MoE where None); ``extra``: more options of every engine; ``own_store``:
    the group meets in a ``rendezvous-store`` process (no engine hosts it: rank 0 is a rank like any other)."""
    from megatron_serve.client.coordinator_client import InferenceClient  # noqa: PLC0415

    if model_dir is None:
        model_dir = str(make_tiny_model(tmp_path / "m", seed=1, num_heads=4, num_kv_heads=2, **VARIANTS["qwen3_moe"]))
    group = ExpertGroup(Children(tmp_path), model_dir, free_port(), tokens, extra=extra, ranks=ranks,
                        rendezvous={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    try:
        if own_store:
            group.children.spawn(["rendezvous-store", "--port", group.rendezvous["MASTER_PORT"]], "store")
            group.rendezvous["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        group.children.coordinator(model_dir, group.port)
        group.engines = [group.engine(rank) for rank in range(ranks)]
        group.client = InferenceClient(f"tcp://127.0.0.1:{group.port}", token=group.children.secret)
        await group.client.start(timeout=60)
        await group.children.registered(group.client, ranks)  # fails at once if an engine exits
        group.quiet = await asyncio.gather(*(client_stream(group.client, p, tokens) for p in PROMPTS))
        assert all(q.completed for q in group.quiet), [q.error for q in group.quiet]
        yield group
    finally:
        if group.client is not None:
            group.client.close()
        group.children.kill_all()
