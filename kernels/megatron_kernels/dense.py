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

One row (a decode step of one sequence) takes ``F.linear`` whatever the weight: both libraries then run a
matrix-vector kernel that reads the weight once, and MKL's took 0.64-0.88 of oneDNN's CPU time on SmolLM2-135M's
layer shapes on an Intel Xeon, streamed from memory or hot in cache (``benchmarks/dense_rows.py``; figures in
docs/benchmarks.md). From two rows on the blocked copy is kept: MKL was faster on the narrower layers at 2-4 rows
but up to 2.3x slower on the widest (gate|up), and its rows round as one kernel from 2 to 15 rows and as another
from 16, where the blocked copy's round alike at every count. (An AMD EPYC's one-row figures were not measured.)

A row's result does not depend on the other rows of the call from two rows on (one row runs MKL's
matrix-vector kernel) for a model's weight, which takes the blocked copy below; ``--batch-invariant`` has its own GEMMs
(:mod:`megatron_kernels.invariant`). A plain weight does not promise it: the oneDNN of torch 2.11 on a GPU host's
Xeon chose other kernels for 2-15 rows of it (torch 2.13 on the CPU machines did not).

Called with a plain weight, oneDNN reorders it into its blocked layout on every call. A model's own weight (an
``nn.Parameter``) is reordered once instead, and the blocked copy kept beside it (the dense weights' memory twice
over) until the weight is written: its version counter moves with every in-place write, a refit's included, so
the next call reorders again. The blocked copy gives the plain weight's bits where oneDNN runs the same kernel for
both (from 16 rows on every CPU measured); the figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
ONEDNN_MIN_WEIGHT = 1 << 17  # elements (e.g. 512 x 256): the crossover measured in docs/design-measurements.md
BLOCKED = ONEDNN and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
BLOCKED_ROWS_HINT = 64  # the rows oneDNN lays the blocked weight out for: a decode step's (16 and up measured alike)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN for float32 tensors on a CPU with a large enough weight."""
    if (ONEDNN and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.numel() >= ONEDNN_MIN_WEIGHT and x.numel() > x.shape[-1]):  # two rows or more
        return torch.ops.mkldnn._linear_pointwise(x, _blocked(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)  # one row: MKL's matrix-vector kernel (the module's docstring)


def _blocked(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in oneDNN's blocked layout, reordered on first use and after every write to it; a tensor that is
    not a model's parameter (a weight dequantized for one call), or has no version counter (an inference tensor),
    as it is."""
    if not (BLOCKED and isinstance(weight, torch.nn.Parameter)) or weight.is_inference():
        return weight
    key = (weight.data_ptr(), weight._version)
    kept = getattr(weight, "_onednn_blocked", None)
    if kept is None or kept[0] != key:
        kept = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BLOCKED_ROWS_HINT))
        weight._onednn_blocked = kept
    return kept[1]
