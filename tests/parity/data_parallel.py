"""A case under data-parallel attention (``data_parallel_size`` with ``enable_expert_parallel``): one engine process
per data-parallel rank (``tests/parallel/data_parallel_runs.py``), the case's requests dealt to the ranks in turn
(request ``i`` to rank ``i % N``: a lone request leaves the others idle, each joining the MoE layers empty), each
arriving at its step; the ranks step together, so a request's arrival step means what it means on one engine."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from megatron_serve import DynamicInferenceRequest, InferenceConfig

from ..parallel.data_parallel_runs import Case as GroupCase, Request, serve_cases


def run_data_parallel(model_dir: Path, config: InferenceConfig, requests: list[Request]
                      ) -> dict[str, DynamicInferenceRequest]:
    """Every request served by ``config.data_parallel_size`` engines, finished; by request id. Each rank computes on
    one thread, as the search's own process does."""
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    fields: dict[str, Any] = {k: v for k, v in config.to_dict().items()
                              if k not in ("data_parallel_size", "data_parallel_rank", "tensor_parallel_size")}
    runs = [[[request for i, request in enumerate(requests) if i % dp == rank]] for rank in range(dp)]
    with tempfile.TemporaryDirectory(prefix="parity-dp-") as root:
        served = serve_cases(Path(root), [GroupCase("case", str(model_dir), runs, fields)], tp=tp,
                             env={"OMP_NUM_THREADS": "1"})
    return {request.request_id: request for rank in served["case"] for request in rank[0]}

