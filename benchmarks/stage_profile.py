"""Where a served stack's CPU goes, by stage: ``py-spy`` samples each of its processes while a load runs, every
sample's stack is named by the stage of its innermost frame that one of :data:`STAGES` claims, and each thread's
CPU time (``/proc``) is split over the stages in the proportion of its samples.

A sampling profiler, not counters in the runtime: nothing in the served code changes for it, and a frame's stage is
read off its file and function, so a stage moves when the code moves between files. ``py-spy`` reads the processes
from outside (``--nonblocking``: they are never paused) and counts a thread only while it seems to be on a CPU; as it
can take a thread waiting (for a lock, the GIL) for a running one, a thread's samples share out only that thread's
own CPU time: a mostly idle thread's few samples cannot claim a busy thread's time. CPU time is each thread's
``schedstat`` (nanoseconds); a thread that ends during the load takes its time with it.

What the split cannot see: ``py-spy`` takes a thread that is ready to run but waits for a core for a running one, and
such a thread is sampled where it resumes, most often just past a blocking call (the event loop's ``run`` after its
``epoll_wait``, a ZeroMQ receive). On a machine with more runnable threads than cores those stages read high with
time that was no CPU. ``schedstat`` counts that wait too (its second field): :attr:`Sampled.waited` is each process's,
and the benchmark prints it beside the stages, so a reader sees how much of a level's samples may be waiting. Threads that run no Python
(ZeroMQ's I/O threads, named ``ZMQbg/...``) have no sample: their CPU is the ``transport`` stage's. What no stage
claims (garbage collection, logging, a thread no sample reached) is ``other``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

#: (stage, [(file fragment, function names or None for any)]): the first stage, from the innermost frame out, whose
#: fragment is in a frame's file and whose names hold its function claims the sample
STAGES: list[tuple[str, list[tuple[str, frozenset[str] | None]]]] = [
    ("forward (stand-in)", [("stand_in_forward.py", None), ("megatron_serve/engine/runner.py", None)]),
    ("sample", [("megatron_serve/engine/sampling/sampler.py", None), ("megatron_serve/engine/sampling/sampling_state.py", None),
                ("megatron_serve/engine/sampling/logits_processors.py", None), ("megatron_serve/engine/token_append.py", None)]),
    ("detokenize", [("megatron_serve/client/detokenizer.py", None),
                    ("megatron_serve/tokenizer.py", frozenset({"decode", "convert_ids_to_tokens", "token_text"}))]),
    ("tokenize", [("megatron_serve/tokenizer.py", None), ("megatron_serve/client/prompts.py", None),
                  ("transformers/tokenization", None), ("megatron_serve/server/chat_template", None)]),
    ("SSE encode", [("megatron_serve/server/chunks.py", None), ("megatron_serve/server/chunked.py", None),
                    ("megatron_serve/server/streaming.py", None),
                    ("megatron_serve/server/completions.py", frozenset({
                        "whole_item", "_chunk", "_choice", "_logprobs", "_text_choice", "completion_logprobs"})),
                    ("megatron_serve/server/chat.py", frozenset({"whole_item", "_chunk", "_choice", "_logprobs"})),
                    ("uvicorn/protocols/http/", frozenset({"send", "_send", "write"}))]),
    ("output processing", [("megatron_serve/client/output_processor.py", None),
                           ("megatron_serve/server/generation.py", frozenset({
                               "deliver", "_pass", "_finished", "merge_pieces", "results", "start_stream"}))]),
    ("admission", [("megatron_serve/server/tenant", None), ("megatron_serve/server/tenants.py", None),
                   ("megatron_serve/server/intake.py", frozenset({
                       "check_limits", "check_choices", "check_budget", "check_logprobs", "check_prompt_size"})),
                   ("megatron_serve/engine/admission.py", None), ("megatron_serve/engine/tenancy.py", None),
                   ("megatron_serve/coordinator/fair_queue.py", None)]),
    ("HTTP parse", [("megatron_serve/server/connections.py", None), ("megatron_serve/server/intake.py", None),
                    ("megatron_serve/server/fast_routes.py", None), ("megatron_serve/server/http_layer.py", None),
                    ("uvicorn/", None), ("httptools/", None), ("h11/", None), ("starlette/", None),
                    ("fastapi/", None), ("pydantic/", None), ("megatron_serve/server/", frozenset({"parse_body"}))]),
    ("transport", [("megatron_serve/wire/", None), ("zmq/", None), ("megatron_serve/client/link.py", None),
                   ("megatron_serve/engine/process/link.py", None)]),
    ("dispatch", [("megatron_serve/client/", None), ("megatron_serve/coordinator/", None),
                  ("megatron_serve/server/generation.py", None)]),
    ("step plan", [("megatron_serve/engine/scheduler.py", None), ("megatron_serve/engine/step_plan.py", None),
                   ("megatron_serve/engine/kv/", None), ("megatron_serve/engine/sequence.py", None),
                   ("megatron_serve/engine/micro_batches.py", None)]),
    ("engine output", [("megatron_serve/engine/output.py", None), ("megatron_serve/engine/process/drain.py", None),
                       ("megatron_serve/engine/served.py", None)]),
    ("engine loop", [("megatron_serve/engine/", None)]),
    # the event loop's C side: a sample whose innermost Python frame is the loop's run is in uvloop (socket reads and
    # writes, its callbacks' scheduling) or in asyncio's own turn
    ("event loop", [("asyncio/runners.py", None), ("uvloop/", None), ("asyncio/base_events.py", None),
                    ("asyncio/events.py", None), ("selectors.py", None)]),
]
NAMES = [name for name, _ in STAGES] + ["other"]
#: libzmq names its background threads so (``ZMQbg/IO/0``, ``ZMQbg/Reaper``)
NATIVE_TRANSPORT = "ZMQbg"


def stage_of(stack: list[str]) -> str:
    """The stage of one sampled stack (frames outermost first, each ``function (file:line)``)."""
    for frame in reversed(stack):
        function, _, where = frame.partition(" (")
        for name, rules in STAGES:
            for fragment, functions in rules:
                if fragment in where and (functions is None or function in functions):
                    return name
    return "other"


def read_raw(path: Path) -> dict[int, Counter[str]]:
    """Samples by thread id and stage from ``py-spy record --format raw --threads``'s file (``thread (TID): NAME;
    frame;... count`` lines)."""
    counts: dict[int, Counter[str]] = {}
    if not path.exists():
        return counts
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        thread, _, frames = stack.partition(";")
        tid = thread.partition("(")[2].partition(")")[0]
        if frames and count.isdigit() and tid.isdigit():
            counts.setdefault(int(tid), Counter())[stage_of(frames.split(";"))] += int(count)
    return counts


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float, float]]:
    """Each thread of ``pid``: its name, CPU seconds so far and seconds it waited, ready to run, for a core (``/proc``:
    ``schedstat``'s nanoseconds, where ``stat``'s clock ticks count 10 ms at a time). Empty once the process is
    gone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    threads = {}
    for task in tasks:
        try:
            on_cpu, waited = (task / "schedstat").read_text().split()[:2]
            threads[int(task.name)] = ((task / "comm").read_text().strip(), int(on_cpu) / 1e9, int(waited) / 1e9)
        except OSError:  # ended meanwhile
            continue
    return threads


def py_spy() -> str | None:
    """The ``py-spy`` beside this interpreter, or on the path; None where it is not installed."""
    return shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")


@dataclass
class Sampled:
    """One process sampled over one load."""

    pid: int
    role: str
    raw: Path
    spy: subprocess.Popen | None
    started: dict[int, tuple[str, float, float]]
    used: dict[int, tuple[str, float]] = field(default_factory=dict)  # CPU over the load, by thread
    waited: float = 0.0  # seconds its threads were ready to run and waited for a core, over the load (not CPU)
    samples: dict[int, Counter[str]] = field(default_factory=dict)

    @property
    def cpu(self) -> float:
        return sum(seconds for _, seconds in self.used.values())

    def stages(self) -> dict[str, float]:
        """CPU seconds by stage: each thread's CPU split by its samples; ZeroMQ's threads' is transport, a thread
        with CPU and no sample (a short burst between samples, or no Python in it) is other."""
        split: Counter[str] = Counter()
        for tid, (name, seconds) in self.used.items():
            counts = self.samples.get(tid)
            if name.startswith(NATIVE_TRANSPORT):
                split["transport"] += seconds
            elif not counts:
                split["other"] += seconds
            else:
                whole = sum(counts.values())
                for stage, n in counts.items():
                    split[stage] += seconds * n / whole
        return dict(split)


class StageProfile:
    """``py-spy`` on every process of a stack while one load runs: :meth:`start` before it, :meth:`stop` after."""

    def __init__(self, processes: list[tuple[int, str]], out_dir: Path, rate: int = 100) -> None:
        self._processes = processes
        self._out_dir = out_dir
        self._rate = rate
        self._spy = py_spy()
        self._sampled: list[Sampled] = []

    @property
    def sampling(self) -> bool:
        return self._spy is not None

    def start(self, label: str) -> None:
        self._sampled = []
        for pid, role in self._processes:
            raw = self._out_dir / f"{label}-{role}-{pid}.txt"
            spy = None
            if self._spy is not None:
                spy = subprocess.Popen([self._spy, "record", "--pid", str(pid), "--format", "raw", "--threads", "--nonblocking",
                                        "--rate", str(self._rate), "--output", str(raw)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
            self._sampled.append(Sampled(pid, role, raw, spy, thread_cpu_seconds(pid)))

    def stop(self) -> list[Sampled]:
        """Each process's CPU over the load and its samples by stage."""
        for item in self._sampled:
            now = thread_cpu_seconds(item.pid)
            item.used = {tid: (name, seconds - item.started.get(tid, ("", 0.0, 0.0))[1])
                         for tid, (name, seconds, _) in now.items()}
            item.waited = sum(waited - item.started.get(tid, ("", 0.0, 0.0))[2]
                              for tid, (_, _, waited) in now.items())
        for item in self._sampled:
            if item.spy is not None:
                item.spy.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
        for item in self._sampled:
            if item.spy is not None:
                try:
                    item.spy.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    item.spy.kill()
                    item.spy.wait()
            item.samples = read_raw(item.raw)
        return self._sampled
