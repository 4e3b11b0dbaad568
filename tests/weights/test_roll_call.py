"""Trainer rank 0's roll call (:mod:`megatron_serve.client.roll_call`): it waits for the living ranks, not the dead.

Real sockets; the rank that dies is a process of its own, killed (SIGKILL) as a crashed trainer rank is. Rank 0
stops waiting as soon as every other rank read the outcome or is gone, well before its deadline; a rank that is
alive but silent is waited for up to the deadline (never taken for dead); a stranger without the transfer's prefix
counts for nothing, while the same hello with the prefix does (the control).
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import time

import pytest

from megatron_serve.client import roll_call

pytestmark = pytest.mark.timeout(120)

#: What a trainer's timeout would be: the waits below either end well before it, or are given a short deadline.
TIMEOUT = 60.0

RANK = """
import sys
from megatron_serve.client import roll_call
conn = roll_call.attend("127.0.0.1", int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), 30)
print("here", flush=True)
if sys.stdin.readline().strip() == "read":
    roll_call.read(conn)
sys.stdin.readline()
"""


def rank_process(port: int, prefix: str, rank: int) -> subprocess.Popen:
    """A trainer rank other than 0 in a process of its own, attending rank 0's roll call; it reads the outcome when
    told ``read`` on its stdin."""
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(port), prefix, str(rank)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "here"
    return proc


def test_rank_0_stops_waiting_once_the_living_read_and_the_dead_are_gone():
    prefix = secrets.token_hex(16)
    ranks = roll_call.RollCall("127.0.0.1", prefix, 3)
    dying, living = rank_process(ranks.port, prefix, 1), rank_process(ranks.port, prefix, 2)
    try:
        dying.kill()  # SIGKILL: a crashed trainer rank, that never reads
        dying.wait()
        living.stdin.write("read\n")
        living.stdin.flush()
        started = time.monotonic()
        endings = ranks.wait(started + TIMEOUT)
        elapsed = time.monotonic() - started
    finally:
        ranks.close()
        for proc in (dying, living):
            proc.kill()
            proc.wait()
    assert endings == {1: "gone", 2: "read"}
    assert elapsed < TIMEOUT / 2, elapsed


def test_a_living_rank_is_waited_for_and_a_stranger_counts_for_nothing():
    prefix = secrets.token_hex(16)
    ranks = roll_call.RollCall("127.0.0.1", prefix, 4)
    living = rank_process(ranks.port, prefix, 1)  # alive, and has not read yet: never taken for dead
    try:
        # a process that reaches the port without the transfer's prefix, claiming rank 2, then hangs up
        with socket.create_connection(("127.0.0.1", ranks.port)) as stranger:
            stranger.sendall(f"{secrets.token_hex(16)} 2\n".encode())
        # the control: the same with the prefix is rank 3, leaving without reading
        roll_call.attend("127.0.0.1", ranks.port, prefix, 3, 10).close()
        started = time.monotonic()
        endings = ranks.wait(started + 1.0)
        waited = time.monotonic() - started
    finally:
        ranks.close()
        living.kill()
        living.wait()
    assert endings == {1: "missing", 2: "missing", 3: "gone"}
    assert waited >= 1.0
