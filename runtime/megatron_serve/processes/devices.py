"""Which device a process of this machine computes on, answered without importing torch where torch could only say
``cpu``: importing it costs seconds of CPU, and a coordinator, a server or a config made on a machine without GPUs
needs none of it.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from typing import Any


def default_device() -> str:
    """``cuda`` where torch sees a GPU, else ``cpu``: ``torch.cuda.is_available()``, answered without importing torch
    where its build has neither CUDA nor ROCm (its ``version.py`` says so) or where the machine has no GPU driver
    (:func:`gpu_driver_present`): torch would see no GPU there either."""
    if "torch" not in sys.modules and not (_torch_built_for_gpus() and gpu_driver_present()):
        return "cpu"
    import torch  # noqa: PLC0415 - only where torch may see a GPU (or is imported already)

    return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_built_for_gpus() -> bool:
    """Whether the installed torch's ``version.py`` names a CUDA or HIP version (True where it cannot be read)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True
    try:
        return names_gpu_version((Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text())
    except (OSError, SyntaxError, StopIteration):
        return True


def gpu_driver_present(root: Path = Path("/")) -> bool:
    """Whether a Linux machine shows a GPU driver to this process: NVIDIA's device nodes or its kernel module's
    ``/proc/driver/nvidia``, ROCm's ``/dev/kfd``, WSL's ``/dev/dxg``. Without any, CUDA and ROCm find no device
    (a CUDA build of torch on a machine without GPUs, as ``make run`` installs); True elsewhere (torch is asked)."""
    if not sys.platform.startswith("linux"):
        return True
    dev = root / "dev"
    return (any(dev.glob("nvidia*")) or (root / "proc" / "driver" / "nvidia").exists() or (dev / "kfd").exists()
            or (dev / "dxg").exists())


def names_gpu_version(version_py: str) -> bool:
    """Whether a torch ``version.py`` names a CUDA or a HIP version, or leaves either unsaid (``cuda = None`` and
    ``hip = None``: a build for CPUs alone)."""
    built: dict[str, Any] = {}  # "cuda" and "hip" -> the version it names (None: built without)
    for node in ast.parse(version_py).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name) and target.id in ("cuda", "hip"):
                    built[target.id] = node.value.value if isinstance(node.value, ast.Constant) else "unknown"
    return built.keys() != {"cuda", "hip"} or any(version is not None for version in built.values())
