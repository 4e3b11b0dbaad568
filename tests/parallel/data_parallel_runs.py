"""Engines of data-parallel attention as the tests run them: one process per data-parallel rank (each an engine
with its own scheduler and requests, starting its own tensor-parallel ranks), meeting at ``MASTER_ADDR``, stepping
together while any has work (:mod:`megatron_serve.engine.group.data_parallel`).

One group of processes serves every case of its layout, one engine after another (``data_parallel_engine.py``):
starting the processes costs more than a case. A :class:`Launcher` forks every group's processes from one that has
imported the engine, and can serve several layouts of a module: each launcher's start imports torch."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import select
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_serve import SamplingParams
from megatron_serve.wire.request import DynamicInferenceRequest

from ..helpers import hosted_rendezvous

ENGINE = Path(__file__).with_name("data_parallel_engine.py")


@dataclass(frozen=True)
class Request:
    """A request of a run: its prompt (text, or token ids), parameters, and the step before which it arrives."""

    request_id: str
    prompt: str | tuple[int, ...]
    params: SamplingParams
    arrival: int = 0


@dataclass(frozen=True)
class Case:
    """One engine per rank over ``model_dir``: ``runs[d]`` is data-parallel rank ``d``'s runs, each a list of
    requests served together (an empty one: that rank idles while the others serve theirs). ``config``: fields of
    ``InferenceConfig`` beside the layout's; ``unordered``: the control, every rank's MoE combine summed in float32
    instead of in ascending expert order; ``partial_sums``: the control, row-parallel layers add the tensor-parallel
    ranks' partial sums under ``--batch-invariant`` instead of gathering their input; ``graphs``: the ranks capture
    and replay their steps with a CPU stand-in for CUDA graphs (``data_parallel_engine.py``), noting each replay in
    the group's graph log (:func:`graph_log`)."""

    name: str
    model_dir: str
    runs: list[list[list[Request]]]
    config: dict[str, Any] = field(default_factory=dict)
    unordered: bool = False
    partial_sums: bool = False
    graphs: bool = False


Served = dict[str, list[list[list[DynamicInferenceRequest]]]]  # case name -> [rank][run] -> finished requests


class Launcher:
    """``data_parallel_engine.py --serve``: a process that has imported the engine, forking each group's processes
    when :func:`serve_cases` asks (its environment this one's with ``env``). A module that serves several layouts
    keeps one for all of them: a process's start, importing torch, costs some 3 CPU-s."""

    def __init__(self, env: dict[str, str] | None = None):
        replies, reply_end = os.pipe()  # its replies: stdout stays the ranks' (shared, as the test's output)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, str(ENGINE), "--serve", str(reply_end)], stdin=subprocess.PIPE, text=True,
                pass_fds=(reply_end,),
                env={**os.environ, **(env or {}), "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1"})
        except BaseException:
            os.close(replies)
            raise
        finally:
            os.close(reply_end)
        self._replies = os.fdopen(replies)

    def run(self, forked: list[str], timeout: float) -> int:
        """Forks a process for each ``IN OUT`` pair of ``forked`` and waits for them all; returns how many failed."""
        self._proc.stdin.write(json.dumps(forked) + "\n")
        self._proc.stdin.flush()
        if not select.select([self._replies], [], [], timeout)[0]:
            self._proc.kill()
            raise TimeoutError(f"the group's processes still ran after {timeout} s")
        reply = self._replies.readline()
        assert reply, f"the launcher exited (code {self._proc.wait()})"
        return int(reply)

    def close(self) -> None:
        """Ends the launcher (the end of its input)."""
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
            self._replies.close()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_cases(tmp_path: Path, cases: list[Case], tp: int = 1, timeout: float = 900,
                env: dict[str, str] | None = None, launcher: Launcher | None = None) -> Served:
    """Every case on one group of ``len(runs)`` data-parallel ranks of ``tp`` tensor-parallel ranks each (one rank
    alone: a group of one engine), the processes' environment this one's with ``env`` (``launcher``: forked by that
    one, with its environment; without: by one of their own). Returns ``served[case][d][n]``: rank ``d``'s finished
    requests of run ``n``.

    Without data-parallel attention the group's tensor-parallel ranks other than 0 are processes of their own too,
    each following every case's engine in turn (``data_parallel_engine.py``), as ranks on other machines do: an
    engine that spawned its ranks would start them again for each case (from multiprocessing's fork server, an
    interpreter importing torch again), and a rank's start costs more than a case.
    """
    dp = len(cases[0].runs)
    assert all(len(case.runs) == dp for case in cases), "one group serves cases of one layout"
    tmp_path.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stores:  # each case's group meets at a store of its own, hosted here
        meetings = [stores.enter_context(hosted_rendezvous(dp * tp)) for _ in cases]
        if launcher is None:
            launcher = stores.enter_context(Launcher(env))
        else:
            assert env is None, "a launcher's processes have its environment"
        return _run_cases(cases, [int(meeting["MASTER_PORT"]) for meeting in meetings], dp, tp, tmp_path, launcher,
                          timeout)


def _run_cases(cases: list[Case], ports: list[int], dp: int, tp: int, tmp_path: Path, launcher: Launcher,
               timeout: float) -> Served:
    outs = []
    own_ranks = tp if dp == 1 else 1  # processes started here per data-parallel rank (the rest: spawned)
    forked = []  # every process of the group, forked from the launcher
    for rank in range(dp):
        for tp_rank in range(own_ranks):
            inputs, out = (tmp_path / f"dp{dp}-tp{tp}-{rank}-{tp_rank}.{kind}" for kind in ("in", "out"))
            placement = {"WORLD_SIZE": str(tp), "NPROC_PER_NODE": "1", "RANK": str(tp_rank)} if own_ranks > 1 else {}
            with open(inputs, "wb") as f:  # (each process sets its placement's environment as it starts)
                pickle.dump([dict(_for_rank(case, port, rank, dp, tp, tmp_path), tp_rank=tp_rank, env=placement)
                             for case, port in zip(cases, ports)], f)
            if tp_rank == 0:
                outs.append(out)
            forked += [str(inputs), str(out)]
    failed = launcher.run(forked, timeout)
    assert failed == 0, f"{failed} of the group's processes failed"
    ranks = []
    for out in outs:
        with open(out, "rb") as f:
            ranks.append(pickle.load(f))
    return {case.name: [rank[case.name] for rank in ranks] for case in cases}


def graph_log(tmp_path: Path, case: str) -> dict[str, list[str]]:
    """A graphs case's notes, by process: ``replay N`` for each replayed graph of batch ``N``, ``empty N`` for each
    empty MoE pass with buffers of ``N`` tokens (``empty None``: exact counts)."""
    folder = tmp_path / f"graphs-{case.replace(':', '-')}"
    return {path.name: path.read_text().split("\n")[:-1] for path in sorted(folder.iterdir())}


def _for_rank(case: Case, port: int, rank: int, dp: int, tp: int, tmp_path: Path) -> dict[str, Any]:
    config = dict(dict(block_size_tokens=8, device="cpu", enable_expert_parallel=dp * tp > 1), **case.config)
    config.update(tensor_parallel_size=tp, data_parallel_size=dp, data_parallel_rank=rank)
    runs = [[(r.request_id, r.prompt, r.params, r.arrival) for r in run] for run in case.runs[rank]]
    log = tmp_path / f"graphs-{case.name.replace(':', '-')}"
    log.mkdir(exist_ok=True)
    return dict(name=case.name, model_dir=case.model_dir, port=port, unordered=case.unordered,
                partial_sums=case.partial_sums, graphs=case.graphs, graph_log=str(log), config=config, runs=runs)
