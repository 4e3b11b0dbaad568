"""Builds the CPU kernels (``csrc/``) on first use with ``torch.utils.cpp_extension``, for this machine.

Each source is compiled once per source, CPU and installation, into torch's extensions directory
(``TORCH_EXTENSIONS_DIR``, shared by every environment of a user): the library's name carries a digest of the CPU's
instruction set (``-march=native`` code built on one CPU may not run on another, as with a home directory shared
between machines), of torch's version (its C++ ABI), of torch's installation (two venvs of one checkout hold the
same version and source, but build with their own include paths, so one name was rebuilt by each in turn) and of
the source's path, so that two environments never rebuild one library under each other (a process that loads a
rebuilt copy of a library it holds registers its ops twice, which torch aborts on). It needs a C++ compiler,
``ninja`` and ``setuptools``; where a source cannot be built, the ops it serves stay on the PyTorch reference, with
one warning that says why. ``python -m megatron_kernels`` builds them all ahead of time (``make setup`` does for
each venv, and an image can), so that no engine's first step waits for a compiler.

torch serializes the processes that build or load one library with a lock *file* in its build directory, taken at
every load (ninja then finds nothing to do) and waited on while it exists: a process killed holding it (an engine
stopped with SIGKILL in its first step) left every later load of that library waiting forever. Here the loads of a
library take an ``flock`` of their own first, which the kernel releases when its holder dies; under it, a lock file
left in the directory can only be a dead process's, and goes.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import platform
import subprocess
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")

#: Each source (``csrc/<name>.cpp``) and whether it is compiled with ``-ffast-math`` (:func:`compile_flags`).
SOURCES = {"paged_attention": True, "rotary_norm": False, "silu_and_mul": True}

logger = logging.getLogger(__name__)


def build_tag(source: Path) -> str:
    """A short digest of this CPU's architecture and instruction-set flags, torch's version and installation and
    ``source``'s path."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    installation = Path(torch.__file__).resolve().parent
    facts = f"{platform.machine()} {flags} {torch.__version__} {installation} {source.resolve()}"
    return hashlib.sha256(facts.encode()).hexdigest()[:12]


def compile_flags(fast_math: bool) -> list[str]:
    """This CPU's whole instruction set and, on x86, full-width AVX-512 registers (GCC otherwise keeps to 256 bits
    on Intel CPUs). ``fast_math`` lets the compiler reorder sums into vector lanes and vectorize ``exp``; without it
    no multiply-add is contracted, so elementwise arithmetic rounds as PyTorch's separate ops do. Either way only
    the compile sees the flag: linked into a shared library, ``-ffast-math`` would switch the whole process to
    flushing denormals (``crtfastmath``), and torch links with its own flags."""
    flags = ["-O3", "-march=native", "-fopenmp-simd"]
    flags += ["-ffast-math"] if fast_math else ["-ffp-contract=off"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-mprefer-vector-width=512")
    return flags


#: Each source's outcome in this process: a library is loaded once (loaded again, its ops would register twice).
LOADED: dict[str, bool] = {}


def built(source: str) -> bool:
    """Whether ``csrc/<source>.cpp`` is built and loaded (its ops registered under ``torch.ops``)."""
    if source not in LOADED:
        LOADED[source] = _build_and_load(source)
    return LOADED[source]


def _build_and_load(source: str) -> bool:
    path = CSRC / f"{source}.cpp"
    try:
        from torch.utils import cpp_extension  # noqa: PLC0415 - imports setuptools; only when a CPU engine needs it

        name = f"megatron_cpu_{source}_{build_tag(path)}"
        directory = Path(cpp_extension._get_build_directory(name, verbose=False))  # made if missing
        with open(directory / "megatron-build.flock", "a") as holder:
            fcntl.flock(holder, fcntl.LOCK_EX)  # released at the block's end, or by the kernel if this process dies
            (directory / "lock").unlink(missing_ok=True)  # torch's lock file, left by a process that died holding it
            cpp_extension.load(name=name, sources=[str(path)], extra_cflags=compile_flags(SOURCES[source]),
                               is_python_module=False)
    except (ImportError, OSError, RuntimeError, subprocess.CalledProcessError) as error:
        logger.warning("the CPU kernels of %s.cpp could not be built (%s); their ops run the PyTorch reference "
                       "(slower). They need a C++ compiler, ninja and setuptools.", source,
                       str(error).splitlines()[0])
        return False
    return True
