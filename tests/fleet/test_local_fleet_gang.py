"""A local fleet's data-parallel attention group is a gang: its ranks start together at a rendezvous port of their
own, and one rank's death ends every rank and the worker processes they started, then starts them all again on a
fresh port. The children are a stand-in for ``python`` that records each start (its arguments, its rendezvous and
the pid of a worker it spawns, as an engine spawns its tensor-parallel ranks) and sleeps."""

from __future__ import annotations

import logging
import os
import signal
import textwrap

import pytest

from megatron_serve.config import InferenceConfig
from megatron_serve.fleet.local_fleet import LocalFleet

from ..helpers import wait_until
from .test_local_fleet_supervision import alive, install_standin

pytestmark = pytest.mark.timeout(120)

STANDIN = textwrap.dedent("""\
    #!{python}
    import json, os, subprocess, sys, time
    from megatron_serve.wire.security import TOKEN_ENV
    from megatron_serve.processes.lifeline import hold_lifeline
    hold_lifeline()
    args = sys.argv[3:]  # after "-m megatron_serve.cli"
    worker = None
    if args[0] == "engine":  # a tensor-parallel worker rank: in the engine's process group, as multiprocessing's are
        # (recorded once it dies with the engine, as an engine's worker ranks report they started)
        proc = subprocess.Popen([sys.executable, "-c", "import time; from megatron_serve.processes.lifeline import "
                                 "parent_death_signal; parent_death_signal(); print(flush=True); time.sleep(120)"],
                                stdout=subprocess.PIPE)
        proc.stdout.readline()
        worker = proc.pid
    with open({record!r}, "a") as f:
        f.write(json.dumps({{"role": args[0], "pid": os.getpid(), "args": args, "worker": worker,
                             "token": bool(os.environ.get(TOKEN_ENV)),
                             "rendezvous": [os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
                                                                         "NPROC_PER_NODE")]}}) + "\\n")
    if args[0] == "coordinator":
        with open(args[args.index("--address-file") + 1], "w") as f:
            f.write("tcp://127.0.0.1:45999")
    time.sleep(120)
""")


@pytest.fixture
def standin(tmp_path):
    python, starts = install_standin(tmp_path, STANDIN)

    def engines() -> list[dict]:
        return [s for s in starts() if s["role"] == "engine"]

    return python, engines


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def gang_fleet(python: object, tmp_path, groups: int) -> LocalFleet:
    """``run --engines groups -dp 2 -tp 2 --enable-expert-parallel`` over the stand-in: gangs of two ranks (at
    tensor-parallel 2 a group is not elastic: a rank's loss restarts its gang)."""
    config = InferenceConfig(enable_expert_parallel=True, tensor_parallel_size=2)
    fleet = LocalFleet(tmp_path / "model", groups, config, python=str(python), log_dir=tmp_path / "logs",
                       data_parallel_size=2)
    assert (fleet.groups, fleet.num_engines) == (groups, 2 * groups)
    return fleet


def test_a_dead_rank_ends_and_restarts_its_whole_gang_on_a_fresh_rendezvous(standin, tmp_path, caplog):
    python, engines = standin
    caplog.set_level(logging.WARNING, "megatron_serve.local_fleet")
    fleet = gang_fleet(python, tmp_path, groups=1)
    try:
        fleet.start(timeout=60)
        wait_until(lambda: len(engines()) == 2, 60, "both ranks")
        first = sorted(engines(), key=lambda s: flag(s["args"], "--data-parallel-rank"))
        for rank, start in enumerate(first):
            assert (flag(start["args"], "--data-parallel-size"), flag(start["args"], "--data-parallel-rank"),
                    flag(start["args"], "--group"), flag(start["args"], "--tensor-parallel")) == ("2", str(rank), "0",
                                                                                                 "2")
            assert "--enable-expert-parallel" in start["args"]
        assert first[0]["rendezvous"] == first[1]["rendezvous"]
        address, port, world, local = first[0]["rendezvous"]
        assert (address, world, local) == ("127.0.0.1", "4", "2") and int(port) > 0
        fleet.supervise()
        os.kill(first[1]["pid"], signal.SIGKILL)  # rank 1's engine; rank 0's and both workers live on
        wait_until(lambda: len(engines()) == 4, 60, "the gang started again")
        # every process of the old gang was gone before the new one started (the supervisor waits for that)
        assert not any(alive(pid) for s in first for pid in (s["pid"], s["worker"]))
        again = engines()[2:]
        assert sorted(flag(s["args"], "--data-parallel-rank") for s in again) == ["0", "1"]
        assert again[0]["rendezvous"] == again[1]["rendezvous"]
        assert again[0]["rendezvous"][1] != port  # a fresh port: the old store's may still be in TIME_WAIT
        assert all(alive(s["pid"]) and alive(s["worker"]) for s in again)
    finally:
        fleet.kill()
    lost = "its gang lost engine 1 (group 0, data-parallel rank 1): killed by SIGKILL"
    assert fleet.restarts == {"engine 0 (group 0, data-parallel rank 0)": [lost],
                              "engine 1 (group 0, data-parallel rank 1)": ["killed by SIGKILL"]}
    assert any("group 0 lost engine 1 (group 0, data-parallel rank 1): killed by SIGKILL" in r.getMessage()
               and "restarting the gang with a fresh rendezvous in 0.5s" in r.getMessage() for r in caplog.records)
    wait_until(lambda: not any(alive(pid) for s in engines() for pid in (s["pid"], s["worker"])), 30,
               "every engine and worker to end with the fleet")


def test_a_fleet_refuses_data_parallel_attention_without_expert_parallelism(tmp_path):
    with pytest.raises(ValueError, match="data_parallel_size 2 in a group is data-parallel attention, which shares "
                                         "the MoE layers' experts: it needs enable_expert_parallel"):
        LocalFleet(tmp_path / "model", 1, InferenceConfig(), data_parallel_size=2, log_dir=tmp_path)
    with pytest.raises(ValueError, match="data_parallel_size 2 does not serve LoRA adapters"):
        LocalFleet(tmp_path / "model", 1, InferenceConfig(enable_expert_parallel=True, enable_lora=True),
                   data_parallel_size=2, log_dir=tmp_path)
    with pytest.raises(ValueError, match="prefill/decode disaggregation is not implemented with data-parallel"):
        LocalFleet(tmp_path / "model", 1, InferenceConfig(enable_expert_parallel=True), data_parallel_size=2,
                   prefill_engines=1, decode_engines=1, log_dir=tmp_path)


def test_groups_of_ranks_are_gangs_of_their_own(standin, tmp_path):
    """``run --engines 2 -dp 2 -tp 2 --enable-expert-parallel``: two gangs, each at its own rendezvous; a rank of
    group 1 dying restarts group 1 only (not elastic groups: those restart a lost rank alone)."""
    python, engines = standin
    fleet = gang_fleet(python, tmp_path, groups=2)
    try:
        fleet.start(timeout=60)
        wait_until(lambda: len(engines()) == 4, 60, "both gangs")
        by_group = {g: [s for s in engines() if flag(s["args"], "--group") == g] for g in ("0", "1")}
        assert all(sorted(flag(s["args"], "--data-parallel-rank") for s in ranks) == ["0", "1"]
                   for ranks in by_group.values())
        ports = {g: {s["rendezvous"][1] for s in ranks} for g, ranks in by_group.items()}
        assert len(ports["0"]) == len(ports["1"]) == 1 and ports["0"] != ports["1"]
        assert all(s["rendezvous"][2:] == ["4", "2"] for s in engines())  # WORLD_SIZE, NPROC_PER_NODE
        fleet.supervise()
        os.kill(by_group["1"][0]["pid"], signal.SIGKILL)
        wait_until(lambda: len(engines()) == 6, 60, "group 1 started again")
        assert sorted(flag(s["args"], "--group") for s in engines()[4:]) == ["1", "1"]
        assert all(alive(s["pid"]) for s in by_group["0"])  # the other gang runs on untouched
    finally:
        fleet.kill()
    assert sorted(fleet.restarts) == ["engine 2 (group 1, data-parallel rank 0)",
                                      "engine 3 (group 1, data-parallel rank 1)"]


def test_an_elastic_group_meets_in_a_store_of_its_own_restarts_any_lost_rank_alone_and_the_gang_with_the_store(
        tmp_path, caplog):
    """``run -dp 3 --enable-expert-parallel`` on CPU (``InferenceConfig.elastic_expert_group``): the ranks meet in a
    ``rendezvous-store`` process (bound at their rendezvous, started before them, given no fleet secret), so no rank
    hosts it: the ranks left serve on and a lost one's restart joins them, rank 0's included, so only it starts again,
    at the same rendezvous; the store's loss restarts the gang and a fresh store on a fresh one."""
    python, starts = install_standin(tmp_path, STANDIN)
    engines = lambda: [s for s in starts() if s["role"] == "engine"]  # noqa: E731
    stores = lambda: [s for s in starts() if s["role"] == "rendezvous-store"]  # noqa: E731
    caplog.set_level(logging.WARNING, "megatron_serve.local_fleet")
    fleet = LocalFleet(tmp_path / "model", 1, InferenceConfig(enable_expert_parallel=True), python=str(python),
                       log_dir=tmp_path / "logs", data_parallel_size=3)
    try:
        fleet.start(timeout=60)
        wait_until(lambda: len(engines()) == 3 and len(stores()) == 1, 60, "the store and the three ranks")
        first = {flag(s["args"], "--data-parallel-rank"): s for s in engines()}
        (store,) = stores()
        assert [flag(store["args"], "--host"), flag(store["args"], "--port")] == first["0"]["rendezvous"][:2]
        assert not store["token"] and all(s["token"] for s in engines())
        fleet.supervise()
        for lost, count in (("1", 4), ("0", 5)):
            os.kill(first[lost]["pid"], signal.SIGKILL)
            wait_until(lambda: len(engines()) == count, 60, f"rank {lost} started again")
            restarted = engines()[count - 1]
            assert flag(restarted["args"], "--data-parallel-rank") == lost
            assert restarted["rendezvous"] == first[lost]["rendezvous"]  # where the ranks left still meet
            assert all(alive(first[rank]["pid"]) for rank in ("0", "1", "2") if rank != lost)  # they serve on
            assert alive(store["pid"]) and len(stores()) == 1
            first[lost] = restarted
        os.kill(store["pid"], signal.SIGKILL)
        wait_until(lambda: len(engines()) == 8 and len(stores()) == 2, 60, "the gang and a fresh store started again")
        again = engines()[5:]
        assert sorted(flag(s["args"], "--data-parallel-rank") for s in again) == ["0", "1", "2"]
        assert again[0]["rendezvous"][1] == flag(stores()[1]["args"], "--port") != first["0"]["rendezvous"][1]
    finally:
        fleet.kill()
    assert any("engine 0 (group 0, data-parallel rank 0) died (killed by SIGKILL" in r.getMessage()
               and "alone: it joins the ranks that serve on" in r.getMessage() for r in caplog.records)
    assert any("group 0 lost rendezvous store (group 0): killed by SIGKILL" in r.getMessage() for r in caplog.records)
