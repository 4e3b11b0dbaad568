"""Every command checks its inputs before it starts anything, and says in one line what to fix.

The real ``megatron-serve`` processes are run where the point is what a user sees: an
unsupported model fails ``run`` in about a second, before any child process starts (it used to
start a coordinator and an engine, fail after 14 s, and print a ``Task exception was never
retrieved`` traceback), and ``control`` takes a coordinator address without ``tcp://`` (it used to
die with a ZeroMQ traceback).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_serve.commands.inputs import check_model_dir, check_port_free, coordinator_address, parse_port
from megatron_serve.model.tiny import make_tiny_model

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("inputs") / "tiny", seed=0)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_serve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Task exception" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("given,expected", [
    ("127.0.0.1:5555", "tcp://127.0.0.1:5555"),
    ("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6000"),
    ("coordinator.ns.svc", "tcp://coordinator.ns.svc:5555"),
    ("tcp://coordinator", "tcp://coordinator:5555"),
    ("[::1]:7000", "tcp://[::1]:7000"),
    (" 10.0.0.1:5555 ", "tcp://10.0.0.1:5555"),
    ("ipc:///tmp/coordinator", "ipc:///tmp/coordinator"),
])
def test_coordinator_addresses_with_and_without_scheme(given, expected):
    assert coordinator_address(given) == expected


@pytest.mark.parametrize("given", ["http://127.0.0.1:5555", "127.0.0.1:99999", "127.0.0.1:0", "host:port", "a b",
                                   "", "tcp://", "1.2.3.4:5:6"])
def test_bad_coordinator_addresses_say_what_is_expected(given):
    with pytest.raises(ValueError, match="--coordinator must"):
        coordinator_address(given)


def test_ports():
    assert parse_port("0", "--port") == 0 and parse_port(8000, "--port") == 8000
    for bad in (-1, 65536, "x"):
        with pytest.raises(ValueError, match="--port must be a port number"):
            parse_port(bad, "--port")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError, match="choose another --coordinator-port"):
            check_port_free("127.0.0.1", taken.getsockname()[1], "--coordinator-port")
    check_port_free("127.0.0.1", 0, "--coordinator-port")


def broken_copy(tiny_model: Path, tmp_path: Path, *, config: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny_model, target)
    if config is not None:
        raw = json.loads((target / "config.json").read_text())
        raw.update(config)
        (target / "config.json").write_text(json.dumps(raw))
    for name in drop:
        (target / name).unlink()
    return target


@pytest.mark.parametrize("change,message", [
    ({"config": {"architectures": ["GPT2LMHeadModel"]}}, "unsupported architecture ['GPT2LMHeadModel']"),
    ({"config": {"torch_dtype": "float8_e4m3fn", "dtype": None}}, "dtype 'float8_e4m3fn' are not supported"),
    ({"config": {"quantization_config": {"quant_method": "awq"}}}, "quantization method 'awq' is not supported"),
    ({"config": {"hidden_act": "gelu"}}, "hidden_act 'gelu'"),
    ({"drop": ("model.safetensors",)}, "no *.safetensors weights"),
    ({"drop": ("tokenizer.json", "tokenizer_config.json")}, "no tokenizer.json"),
    ({"drop": ("config.json",)}, "no config.json"),
])
def test_model_directories_that_cannot_be_served(tiny_model, tmp_path, change, message):
    model = broken_copy(tiny_model, tmp_path, **change)
    with pytest.raises((ValueError, FileNotFoundError)) as caught:
        check_model_dir(str(model))
    assert message in str(caught.value)


def test_model_directory_checks_the_weights_only_where_they_are_loaded(tiny_model, tmp_path):
    model = broken_copy(tiny_model, tmp_path, drop=("model.safetensors",))
    assert check_model_dir(str(model), weights=False) == model
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_dir(str(tmp_path / "nowhere"))


def test_run_refuses_an_unsupported_model_before_starting_anything(tiny_model, tmp_path):
    model = broken_copy(tiny_model, tmp_path, config={"architectures": ["GPT2LMHeadModel"]})
    log_dir = tmp_path / "logs"
    began = time.monotonic()
    proc = cli("run", "--model", str(model), "--port", "0", "--coordinator-port", "0", "--log-dir", str(log_dir))
    took = time.monotonic() - began
    assert_one_line_error(proc, "megatron-serve run: error:", "unsupported architecture", "GPT2LMHeadModel")
    assert "[1/4]" not in proc.stdout  # no stage began
    assert not log_dir.exists()  # no coordinator or engine was started
    assert took < 60, took  # seconds of imports, not an engine's start-up


def test_run_refuses_a_busy_coordinator_port_before_starting_anything(tiny_model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = cli("run", "--model", str(tiny_model), "--port", "0", "--coordinator-port", str(port),
                   "--log-dir", str(tmp_path / "logs"))
    assert_one_line_error(proc, f"127.0.0.1:{port}", "--coordinator-port")
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("command", [["control", "status"], ["engine", "--model", "MODEL"],
                                     ["server", "--model", "MODEL"]])
def test_commands_refuse_a_malformed_coordinator_address_in_one_line(tiny_model, command):
    args = [str(tiny_model) if a == "MODEL" else a for a in command]
    proc = cli(*args, "--coordinator", "http://127.0.0.1:5555")
    assert_one_line_error(proc, "--coordinator must be HOST:PORT or tcp://HOST:PORT")
