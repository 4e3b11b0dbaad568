"""``x @ W^T + b`` for the model's dense layers: oneDNN's matmul for float32 on a CPU, ``F.linear`` elsewhere.

torch's float32 ``F.linear`` on an x86 CPU calls MKL's sgemm, which picks its code path by the CPU's vendor as
well as its features: on an AMD EPYC with AVX-512 it runs slower code than oneDNN, which torch also ships
(``torch.backends.mkldnn``) and which dispatches on the instruction set alone (``ONEDNN_VERBOSE=1`` names the
kernel it chose; docs/design-measurements.md has the comparison). oneDNN is called through the op
``torch.compile`` uses for its CPU linear layers, with the layer's own weight: nothing is repacked or cached, so a
refit's in-place copy is seen at the next call. Other dtypes already reach oneDNN through ``F.linear`` (bfloat16)
or have no oneDNN path; a device other than a CPU gets ``F.linear``.

oneDNN's call costs a fixed ~10 us more than MKL's, which a small layer's arithmetic does not pay back (a 64 x 64
weight is 7x slower through it at 8 rows), so only weights of ``ONEDNN_MIN_WEIGHT`` elements or more take it. The
choice is the layer's, never the batch's, so that a row's arithmetic does not change with the rows beside it.

A row's result does not depend on the other rows of the call, from two rows on (one row runs a matrix-vector
kernel), as with MKL from four; ``--batch-invariant`` has its own GEMMs (:mod:`megatron_kernels.invariant`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
ONEDNN_MIN_WEIGHT = 1 << 17  # elements (e.g. 512 x 256): the crossover measured in docs/design-measurements.md


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN for float32 tensors on a CPU with a large enough weight."""
    if (ONEDNN and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.numel() >= ONEDNN_MIN_WEIGHT):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
