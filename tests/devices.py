"""The device a test's tensor-parallel engine runs on."""

from __future__ import annotations

import torch


def tensor_parallel_device(size: int) -> str:
    """CUDA where this machine has a GPU for each of ``size`` ranks, else CPU (gloo).

    A one-GPU machine runs the tensor-parallel tests on CPU: NCCL refuses two ranks on one GPU.
    """
    return "cuda" if torch.cuda.device_count() >= size else "cpu"
