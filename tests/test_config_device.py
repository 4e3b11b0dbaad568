"""``InferenceConfig`` imports no torch until it resolves a dtype or asks for a GPU, and its default device is
``torch.cuda.is_available()``'s answer either way."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_serve import config
from megatron_serve.processes import devices


def test_the_default_device_is_torchs_answer():
    assert devices.default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert devices._torch_built_for_gpus() == (torch.version.cuda is not None or torch.version.hip is not None)


@pytest.mark.parametrize(("version_py", "gpus"), [
    ("cuda: Optional[str] = None\nhip: Optional[str] = None\n", False),
    ("cuda: Optional[str] = '12.4'\nhip: Optional[str] = None\n", True),
    ("cuda = None\nhip = '6.2.41133'\n", True),
    ("cuda = None\n", True),  # hip unsaid: torch is asked
])
def test_a_build_for_gpus_is_read_from_torchs_version_file(version_py, gpus):
    assert devices.names_gpu_version(version_py) is gpus


def test_a_config_of_default_dtype_is_made_and_sent_without_torch():
    code = ("import sys; from megatron_serve.config import InferenceConfig; c = InferenceConfig(); "
            "print(c.device, c.to_dict()['dtype'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    torch_asked = devices._torch_built_for_gpus() and devices.gpu_driver_present()
    assert out == [devices.default_device(), "None", str(torch_asked)]


@pytest.mark.parametrize(("paths", "present"), [
    ((), False),  # a machine without GPUs: a CUDA build of torch would see none
    (("dev/nvidiactl", "dev/nvidia0"), True),
    (("proc/driver/nvidia/version",), True),  # the module loaded, its device nodes made on first use
    (("dev/kfd",), True),  # ROCm
    (("dev/dxg",), True),  # WSL
    (("dev/null", "proc/driver/rtc"), False),
])
def test_a_gpu_driver_is_seen_by_its_device_files(tmp_path, monkeypatch, paths, present):
    monkeypatch.setattr(sys, "platform", "linux")
    (tmp_path / "dev").mkdir()
    (tmp_path / "proc" / "driver").mkdir(parents=True)
    for path in paths:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    assert devices.gpu_driver_present(tmp_path) is present


def test_a_named_dtype_becomes_torchs_and_is_sent_by_name():
    made = config.InferenceConfig(dtype="bfloat16", device="cpu")
    assert made.dtype is torch.bfloat16 and made.to_dict()["dtype"] == "bfloat16"
    assert config.InferenceConfig(dtype=torch.float16, device="cpu").to_dict()["dtype"] == "float16"
