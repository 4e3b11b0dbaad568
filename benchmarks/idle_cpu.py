"""The CPU an idle stack spends per second, by process: what its clocks, heartbeats and status polls cost with no
request in flight (issue 84: a share of every served token's CPU at a few thousand tokens a second, and paid by every
process of a fleet at rest).

Starts ``megatron-serve run`` on a tiny model as ``serving.py`` does, waits until it is ready and has settled, then
reads each process's threads' CPU time (``/proc/PID/task/*/schedstat``, nanoseconds: the clock ticks of ``stat`` are
too coarse for a few ms a second) over ``--seconds`` of idleness, ``--rounds`` times.

    python benchmarks/idle_cpu.py                        # 3 rounds of 10 s
    python benchmarks/idle_cpu.py --seconds 5 --rounds 1 --run-args "--api-server-count 2"
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scratch import scratch_dir  # noqa: E402
from serving_stack import stack_processes, start_stack, stop_stack  # noqa: E402

ROLES = ("server", "coordinator", "engines")


def cpu_ns(pid: int) -> int:
    """CPU nanoseconds of all of ``pid``'s threads so far (0 when it is gone)."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    except OSError:
        return total
    return total


def by_role(run_pid: int) -> dict[str, int]:
    """CPU nanoseconds so far of the stack's processes, by role (the ``run`` process counts as the server)."""
    used = dict.fromkeys(ROLES, 0)
    used["server"] = cpu_ns(run_pid)
    for pid, role in stack_processes(run_pid):
        used[role] += cpu_ns(pid)
    return used


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def rounds(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=positive, default=10.0, help="idle seconds per round")
    parser.add_argument("--rounds", type=rounds, default=3)
    parser.add_argument("--settle", type=positive, default=3.0, help="seconds after ready before the first round")
    parser.add_argument("--run-args", default="", help="extra `megatron-serve run` options")
    args = parser.parse_args()
    if not Path("/proc/self/task").is_dir():
        raise SystemExit("idle_cpu.py reads /proc (Linux)")
    from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415 - after the arguments are checked

    model = make_tiny_model(scratch_dir("bench-tiny-") / "tiny-llama")
    proc, url, _output = start_stack(str(model), 1, args.run_args)
    rows: list[dict[str, float]] = []
    try:
        time.sleep(args.settle)  # the start-up's own work (imports, the first status polls) is not idle
        for _ in range(args.rounds):
            before = by_role(proc.pid)
            time.sleep(args.seconds)
            after = by_role(proc.pid)
            rows.append({role: (after[role] - before[role]) / 1e6 / args.seconds for role in ROLES})
    finally:
        stop_stack(proc)
    print(f"idle stack at {url}: CPU ms per second, {args.rounds} round(s) of {args.seconds:g} s")
    print("| round | " + " | ".join(ROLES) + " |")
    print("|---|" + "---|" * len(ROLES))
    for i, row in enumerate(rows, 1):
        print(f"| {i} | " + " | ".join(f"{row[role]:.2f}" for role in ROLES) + " |")
    print("| median | " + " | ".join(f"{statistics.median(r[role] for r in rows):.2f}" for role in ROLES) + " |")


if __name__ == "__main__":
    main()
