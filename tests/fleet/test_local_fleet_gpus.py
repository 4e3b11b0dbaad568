"""A local fleet on GPUs gives each engine group GPUs of its own (``CUDA_VISIBLE_DEVICES``).

The fleet's processes are a stand-in interpreter (``python=``) that records what each engine was
started with: the real engines would need the GPUs this machine may not have.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time

import pytest

from megatron_serve.config import InferenceConfig
from megatron_serve.fleet.local_fleet import LocalFleet, gpu_slices, visible_gpus

RECORDER = textwrap.dedent("""\
    #!{python}
    import json, os, sys, time
    args = sys.argv[3:]  # after "-m megatron_serve.cli"
    if args[0] == "coordinator":  # publishes its address whole, as the coordinator does (a CI run read it empty)
        path = args[args.index("--address-file") + 1]
        with open(path + ".tmp", "w") as f:
            f.write("tcp://127.0.0.1:1")
        os.replace(path + ".tmp", path)
        time.sleep(60)
    else:
        with open({record!r}, "a") as f:
            f.write(json.dumps({{"args": args, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}}) + "\\n")
""")


def test_each_engine_group_takes_the_next_gpus_in_order():
    assert gpu_slices(["0", "1", "2", "3"], 2, 2) == ["0,1", "2,3"]
    assert gpu_slices(["4", "6", "7"], 3, 1) == ["4", "6", "7"]
    assert gpu_slices(["0", "1", "2"], 1, 2) == ["0,1"]  # a GPU left over stays free


def test_more_ranks_than_gpus_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"2 engine\(s\) of 2 GPU\(s\) each need 4 GPUs, but 3 are visible "
                                         r"\(0,1,2\): lower --engines or --tensor-parallel, or serve on --device cpu"):
        gpu_slices(["0", "1", "2"], 2, 2)
    with pytest.raises(ValueError, match=r"need 1 GPUs, but 0 are visible \(none\)"):
        gpu_slices([], 1, 1)


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")
    assert visible_gpus() == ["2", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_engine_processes_start_with_their_own_gpus_and_tensor_parallel_flag(tmp_path, monkeypatch):
    record = tmp_path / "engines.jsonl"
    python = tmp_path / "python"
    python.write_text(RECORDER.format(python=sys.executable, record=str(record)))
    python.chmod(0o755)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5,6,7")
    fleet = LocalFleet(tmp_path / "model", 2, InferenceConfig(device="cuda", tensor_parallel_size=2),
                       python=str(python), log_dir=tmp_path / "logs")
    try:
        fleet.start(timeout=60)
        fleet.add_engine(group=1)  # a replacement engine takes its group's GPUs
        deadline = time.monotonic() + 60
        while len(record.read_text().splitlines() if record.exists() else []) < 3:
            assert time.monotonic() < deadline, "the engines did not start"
            time.sleep(0.05)
    finally:
        fleet.kill()
    started = [json.loads(line) for line in record.read_text().splitlines()]
    by_group = sorted((s["args"][s["args"].index("--group") + 1], s["gpus"]) for s in started)
    assert by_group == [("0", "3,4"), ("1", "5,6"), ("1", "5,6")]
    assert all(s["args"][s["args"].index("--tensor-parallel") + 1] == "2" for s in started)


def test_a_fleet_on_cpu_leaves_the_gpus_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    fleet = LocalFleet(tmp_path / "model", 3, InferenceConfig(device="cpu", tensor_parallel_size=2),
                       log_dir=tmp_path / "logs")
    assert fleet.gpus is None and fleet.engine_args[-2:] == ["--tensor-parallel", "2"]
