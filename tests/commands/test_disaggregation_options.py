"""Prefill/decode disaggregation's options refuse what cannot serve, naming the option, before anything starts:
``run --prefill-engines/--decode-engines``, ``engine --kv-transfer-config`` and ``LocalFleet``'s keywords."""

from __future__ import annotations

import json

import pytest

from megatron_serve.cli import parse_args
from megatron_serve.fleet.argv import disaggregated_roles, kv_role_argv, kv_transfer_config
from megatron_serve.fleet.local_fleet import LocalFleet

from tests.commands.helpers import run_refuses


@pytest.mark.parametrize("argv, problem", [
    (["--prefill-engines", "1"], "--prefill-engines needs --decode-engines >= 1"),
    (["--decode-engines", "2"], "--decode-engines needs --prefill-engines >= 1"),
    (["--prefill-engines", "-1", "--decode-engines", "1"], "--prefill-engines must be >= 0, got -1"),
    (["--prefill-engines", "1", "--decode-engines", "-2"], "--decode-engines must be >= 0, got -2"),
    (["--engines", "3", "--prefill-engines", "1", "--decode-engines", "1"], "--engines 3 with --prefill-engines 1"),
    (["--prefill-engines", "1", "--decode-engines", "1", "--data-parallel-size", "2", "--enable-expert-parallel"],
     "prefill/decode disaggregation is not implemented with data-parallel attention"),
])
def test_run_refuses_a_layout_that_cannot_serve_by_name(tmp_path, argv, problem):
    run_refuses(tmp_path, argv, problem)


def test_run_counts_the_prefill_and_decode_engines_as_its_engines():
    assert disaggregated_roles(1, 0, 0) == ["kv_both"]
    assert disaggregated_roles(3, 0, 0) == ["kv_both"] * 3
    assert disaggregated_roles(1, 1, 2) == ["kv_producer", "kv_consumer", "kv_consumer"]
    assert disaggregated_roles(3, 1, 2) == disaggregated_roles(1, 1, 2)  # --engines may say their sum


@pytest.mark.parametrize("text, problem", [
    ("kv_producer", "--kv-transfer-config must be a JSON object"),
    ('["kv_producer"]', "--kv-transfer-config must be a JSON object"),
    ('{"kv_role": "prefill"}', "kv_role must be one of kv_producer, kv_consumer, kv_both, got 'prefill'"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}', "kv_connector 'NixlConnector' is not available"),
    ('{"kv_role": "kv_producer", "kv_rank": 0}', "unknown key\\(s\\) kv_rank"),
])
def test_an_engine_refuses_a_bad_kv_transfer_config_by_name(text, problem):
    with pytest.raises(ValueError, match=problem):
        kv_transfer_config(text)


def test_an_engine_reads_vllm_s_kv_transfer_config():
    assert kv_transfer_config('{"kv_connector": "CoordinatorConnector", "kv_role": "kv_consumer"}') == "kv_consumer"
    assert kv_transfer_config("{}") == "kv_both"
    flag, value = kv_role_argv("kv_producer")
    assert flag == "--kv-transfer-config" and kv_transfer_config(value) == "kv_producer"
    assert json.loads(value)["kv_connector"] == "CoordinatorConnector"


def test_an_engine_refuses_a_role_with_data_parallel_attention_before_loading(tmp_path):
    from megatron_serve.commands import engine

    args = parse_args(["engine", "--model", str(tmp_path), "--coordinator", "tcp://127.0.0.1:1",
                       "--data-parallel-size", "2", "--enable-expert-parallel",
                       "--kv-transfer-config", '{"kv_role": "kv_producer"}'])
    with pytest.raises(ValueError, match="kv_role kv_producer is not implemented with data-parallel attention"):
        engine.run(args)
    bad = parse_args(["engine", "--model", str(tmp_path), "--coordinator", "tcp://127.0.0.1:1",
                      "--kv-transfer-config", '{"kv_role": "both"}'])
    with pytest.raises(ValueError, match="--kv-transfer-config: kv_role must be one of"):
        engine.run(bad)


def test_a_local_fleet_refuses_prefill_engines_without_decode_engines(tmp_path):
    with pytest.raises(ValueError, match="--prefill-engines needs --decode-engines"):
        LocalFleet(tmp_path, prefill_engines=1, log_dir=tmp_path / "logs")
    with pytest.raises(ValueError, match="--engines 2 with --prefill-engines 2 and --decode-engines 1"):
        LocalFleet(tmp_path, 2, prefill_engines=2, decode_engines=1, log_dir=tmp_path / "logs")
