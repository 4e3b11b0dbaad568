"""``run``'s ``--data-parallel-size`` as vLLM means it: alone, that many replicas (``--engines``); with
``--enable-expert-parallel``, groups of that many data-parallel attention ranks sharing the experts (``--engines M``:
M groups). What cannot serve is refused before anything starts, naming the option; vLLM's flags for ranks spread over
hosts are refused naming the engine command that does that."""

from __future__ import annotations

import pytest

from megatron_serve.cli import parse_args
from megatron_serve.commands.run import fleet_layout

from tests.commands.helpers import run_refuses


def test_data_parallel_size_is_replicas_alone_and_attention_ranks_with_expert_parallelism():
    assert fleet_layout(1, None, False) == (1, 1) and fleet_layout(3, None, True) == (3, 1)
    assert fleet_layout(1, 2, False) == (2, 1)  # vLLM: -dp 2 on a dense model is two replicas
    assert fleet_layout(2, 2, False) == (2, 1)  # --engines may say the same
    assert fleet_layout(1, 2, True) == (1, 2)  # one group of two attention ranks
    assert fleet_layout(3, 2, True) == (3, 2)  # three such groups
    for argv in (["--data-parallel-size", "4"], ["-dp", "4"]):
        args = parse_args(["run", "--model", "/m", *argv, "--enable-expert-parallel"])
        assert (args.data_parallel_size, args.engines, args.enable_expert_parallel) == (4, 1, True)
    assert parse_args(["serve", "/m", "-dp", "2"]).data_parallel_size == 2


@pytest.mark.parametrize("argv, problem", [
    (["-dp", "2", "--engines", "3"], "--data-parallel-size 2 without --enable-expert-parallel is 2 engine groups "
                                     r"\(--engines\), but --engines 3 says otherwise"),
    (["-dp", "0"], "--data-parallel-size must be >= 1, got 0"),
    (["-dp", "2", "--enable-expert-parallel", "--enable-lora"], "data_parallel_size 2 does not serve LoRA adapters"),
    (["-dp", "2", "--enable-expert-parallel", "--pipeline-parallel-size", "2"],
     "data_parallel_size 2 does not serve pipeline_parallel_size > 1"),
    (["-dp", "2", "--enable-expert-parallel", "--prefill-engines", "1", "--decode-engines", "1"],
     "prefill/decode disaggregation is not implemented with data-parallel attention"),
])
def test_run_refuses_a_data_parallel_layout_that_cannot_serve_by_name(tmp_path, argv, problem):
    run_refuses(tmp_path, argv, problem)


@pytest.mark.parametrize("command", [["run", "--model", "/m"], ["serve", "/m"]])
@pytest.mark.parametrize("flag", ["--data-parallel-size-local", "--data-parallel-start-rank", "--data-parallel-address",
                                  "--data-parallel-rpc-port"])
def test_vllms_multi_host_data_parallel_flags_are_refused_by_run_naming_the_engine_command(command, flag, capsys):
    with pytest.raises(SystemExit):
        parse_args([*command, flag, "1"])
    error = capsys.readouterr().err
    assert f"{flag}: a data-parallel group spread over hosts runs one `megatron-serve engine --data-parallel-size N " \
           "--data-parallel-rank D --enable-expert-parallel` per attention rank" in error, error


ENGINE = ["engine", "--model", "/m", "--coordinator", "tcp://127.0.0.1:1"]
GANG = ["--enable-expert-parallel", "--data-parallel-size", "2", "--tensor-parallel", "2"]


def test_an_engine_takes_vllms_multi_host_flags_as_its_rendezvous_and_rank(monkeypatch):
    """``vllm serve ... --data-parallel-size-local 1 --data-parallel-start-rank 1 --data-parallel-address A
    --data-parallel-rpc-port P`` on the second host is this engine's rank 1, meeting rank 0 at ``A:P``."""
    from megatron_serve.commands import engine
    from megatron_serve.engine.group.placement import Placement, data_parallel_placement

    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NPROC_PER_NODE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    config = engine.layout_config(parse_args([*ENGINE, *GANG, "--data-parallel-size-local", "1",
                                              "--data-parallel-start-rank", "1", "--data-parallel-address", "10.0.0.1",
                                              "--data-parallel-rpc-port", "29555"]))
    assert (config.data_parallel_size, config.data_parallel_rank) == (2, 1)
    assert data_parallel_placement(config) == Placement(4, 2, 2, "10.0.0.1", 29555)  # ranks 2 and 3 of 4


@pytest.mark.parametrize("argv, problem", [
    ([*GANG, "--data-parallel-size-local", "2"], "--data-parallel-size-local must be 1, got 2: each data-parallel "
                                                 "rank is an engine command of its own"),
    ([*GANG, "--data-parallel-rpc-port", "0"], r"--data-parallel-rpc-port must be a port number in 1\.\.65535"),
    ([*GANG, "--data-parallel-rpc-port", "x"], r"--data-parallel-rpc-port must be a port number"),
    ([*GANG, "--data-parallel-address", " "], "--data-parallel-address is empty"),
    (["--data-parallel-address", "10.0.0.1"], "--data-parallel-address is where data-parallel attention ranks meet: "
                                              "it needs --data-parallel-size > 1"),
])
def test_an_engine_refuses_multi_host_flags_that_cannot_serve_by_name(monkeypatch, argv, problem):
    from megatron_serve.commands import engine

    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=problem):
        engine.layout_config(parse_args([*ENGINE, *argv]))


def test_control_status_shows_each_attention_rank_of_a_group():
    from megatron_serve.commands.control import format_status

    def engine(rank: int | None, **info: object) -> dict:
        dp = {} if rank is None else {"data_parallel_rank": rank, "data_parallel_size": 2}
        return {"id": f"e{rank}", "group": 0, "state": "RUNNING", "running": 0, "waiting": 0, "kv_blocks_free": 1,
                "kv_blocks_total": 1, "info": {"tensor_parallel_size": 2, "expert_parallel": True, **dp, **info}}

    status = {"state": "RUNNING", "queued": 0, "in_flight": 0, "completed": 0, "failed": 0,
              "engines": [engine(0), engine(1), engine(None)]}
    rows = format_status(status).splitlines()[2:]
    assert [row.split()[0] + " " + " ".join(w for w in row.split() if w[:2] in ("tp", "ep", "dp")) for row in rows] \
        == ["e0 tp2 ep4 dp0/2", "e1 tp2 ep4 dp1/2", "eNone tp2 ep2"]  # ep = tp x dp
