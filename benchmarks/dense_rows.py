"""The CPU's float32 GEMM paths at a decode step's few rows, on a real model's layer shapes (issue 84, item 6).

The engine's dense layers (:mod:`megatron_kernels.dense`) call oneDNN with each weight reordered once for 64 rows
(``BLOCKED_ROWS_HINT``), from two rows on; ``transformers`` calls ``F.linear`` (MKL). This times, per layer shape
and row count, the thread CPU time of one call through each path torch offers on a CPU:

* ``onednn64``: oneDNN on the weight blocked for 64 rows (the engine's path from two rows on);
* ``onednn_rows``: oneDNN on the weight blocked for exactly this row count;
* ``onednn_plain``: oneDNN on the plain weight (the engine's path at one row);
* ``mkl``: ``F.linear`` (MKL's sgemm on the plain weight);
* ``mkl_packed``: MKL's packed GEMM on the weight packed for this row count (``torch.compile``'s CPU path with
  frozen weights).

A decode step streams every layer's weight once, so each call here takes the next of ``--copies`` copies of the
weight (by default enough to pass 200 MB, as a model's layers do), not one weight hot in cache. The arms alternate
within each round; the table gives each arm's median over rounds, in microseconds a call and GFLOP/s.

    OMP_NUM_THREADS=1 python benchmarks/dense_rows.py                      # SmolLM2-135M's shapes
    OMP_NUM_THREADS=1 python benchmarks/dense_rows.py --shapes 960x576 --rows 1,2,4 --rounds 3
    OMP_NUM_THREADS=1 python benchmarks/dense_rows.py --stream-mb 0 --rounds 200   # one weight, hot in cache
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

# SmolLM2-135M as the engine fuses it (out x in): q|k|v, o, gate|up, down, the tied LM head.
SMOLLM2_SHAPES = "960x576,576x576,3072x576,576x1536,49152x576"
ARMS = ("onednn64", "onednn_rows", "onednn_plain", "mkl", "mkl_packed")
Call = Callable[[torch.Tensor], torch.Tensor]


def parse_shape(text: str) -> tuple[int, int]:
    out_features, in_features = (int(part) for part in text.lower().split("x"))
    return out_features, in_features


def arm_calls(arm: str, weights: list[torch.Tensor], rows: int) -> list[Call]:
    """One call per weight copy for ``arm`` at ``rows`` rows (its layouts prepared here, before any timing)."""
    onednn = torch.ops.mkldnn._linear_pointwise
    if arm in ("onednn64", "onednn_rows"):
        hint = 64 if arm == "onednn64" else rows
        blocked = [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in weights]
        return [lambda x, b=b: onednn(x, b, None, "none", [], "") for b in blocked]
    if arm == "onednn_plain":
        return [lambda x, w=w: onednn(x, w, None, "none", [], "") for w in weights]
    if arm == "mkl":
        return [lambda x, w=w: F.linear(x, w) for w in weights]
    if arm == "mkl_packed":
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        return [lambda x, p=p, w=w: torch.ops.mkl._mkl_linear(x, p, w, None, rows) for p, w in zip(packed, weights)]
    raise ValueError(arm)


def time_calls(calls: list[Call], x: torch.Tensor) -> float:
    """Thread CPU seconds per call over one sweep of every weight copy."""
    start = time.thread_time()
    for call in calls:
        call(x)
    return (time.thread_time() - start) / len(calls)


def sweep(shape: tuple[int, int], rows_list: list[int], arms: list[str], rounds: int,
          copies: int) -> dict[tuple[int, str], float]:
    """Median seconds per call for each (rows, arm): a round sweeps the copies once per arm, the arms' order
    rotating from round to round, so that the host's load moving (other processes' memory traffic) falls on every
    arm alike."""
    out_features, in_features = shape
    weights = [torch.randn(out_features, in_features) for _ in range(copies)]
    times: dict[tuple[int, str], list[float]] = {}
    for rows in rows_list:
        x = torch.randn(rows, in_features)
        prepared = {arm: arm_calls(arm, weights, rows) for arm in arms}
        reference = F.linear(x, weights[0])
        for arm, calls in prepared.items():  # every path computes the same product
            torch.testing.assert_close(calls[0](x), reference, atol=1e-3, rtol=1e-3)
        for arm in arms:  # untimed: the first call of a path allocates its scratch
            time_calls(prepared[arm], x)
        for round_ in range(rounds):
            for arm in arms[round_ % len(arms):] + arms[:round_ % len(arms)]:
                times.setdefault((rows, arm), []).append(time_calls(prepared[arm], x))
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=SMOLLM2_SHAPES, help="out x in, comma-separated")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--rounds", type=int, default=15, help="alternated rounds; the median is reported")
    parser.add_argument("--stream-mb", type=float, default=200.0,
                        help="weight copies to pass this many MB (0: one weight, hot in cache)")
    args = parser.parse_args()
    arms = args.arms.split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); us a call (GFLOP/s), median of "
          f"{args.rounds} rounds")
    print("| shape (out x in) | rows | " + " | ".join(arms) + " | fastest |")
    print("|---|---|" + "---|" * (len(arms) + 1))
    for text in args.shapes.split(","):
        shape = parse_shape(text)
        copies = max(1, round(args.stream_mb * 1e6 / (shape[0] * shape[1] * 4)))  # 1 where stream-mb is 0
        medians = sweep(shape, rows_list, arms, args.rounds, copies)
        for rows in rows_list:
            flops = 2 * rows * shape[0] * shape[1]
            cells = [f"{medians[rows, arm] * 1e6:.0f} ({flops / medians[rows, arm] / 1e9:.0f})" for arm in arms]
            fastest = min(arms, key=lambda arm: medians[rows, arm])
            print(f"| {text} x{copies} | {rows} | " + " | ".join(cells) + f" | {fastest} |", flush=True)


if __name__ == "__main__":
    main()
