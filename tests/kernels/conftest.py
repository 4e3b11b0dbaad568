"""Kernel tests run natively on CUDA, else under the Triton interpreter (set before triton is imported)."""

import os

import torch

from ..threads import default_threads  # noqa: F401 - autouse: this folder runs at torch's default threads
from ..triton_interpreter import install

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
install()  # after TRITON_INTERPRET: triton is imported here
