"""EPLB on ``/metrics`` of a real run (``run --tensor-parallel 2 --enable-expert-parallel --enable-eplb``, the
ranks separate processes over gloo) whose router favours two experts: once the streams are done, the group's engine
reports each MoE layer's balancedness by decoder layer (the dense layer 1 has none), measured over a window after its
experts moved, at least 0.9; its rearrangements, the layers moved and the seconds the steps waited for them."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import http_get
from tests.run_stack import complete, start_run

from .test_expert_parallel_eplb import PROMPTS, skewed_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOKENS = 40
#: a plan every 8 steps from the last 8: the first moves both MoE layers, a later one measures where they went
EPLB = {"window_size": 8, "step_interval": 8, "num_redundant_experts": 4}


def eplb_samples(text: str) -> dict[str, dict[tuple[str, ...], float]]:
    """The EPLB families of a ``/metrics`` page: name -> (engine_group, and layer where it has one) -> value."""
    found: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("megatron_serve_eplb_") and not sample.name.endswith("_created"):
                key = tuple(sample.labels[k] for k in ("engine_group", "layer") if k in sample.labels)
                found.setdefault(sample.name.removeprefix("megatron_serve_eplb_"), {})[key] = sample.value
    return found


def metrics_after(url: str, generated: int) -> str:
    """``/metrics`` once the engine's heartbeat counts ``generated`` tokens: its report after the last step."""
    deadline = time.monotonic() + 60
    while True:
        text = http_get(f"{url}/metrics", timeout=10).text
        counted = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                      if s.name == "megatron_serve_generation_tokens_total")
        if counted >= generated:
            return text
        assert time.monotonic() < deadline, f"the engine's heartbeat counted {counted} of {generated} tokens"
        time.sleep(0.1)


async def test_balancedness_rearrangements_and_their_time_reach_metrics(tmp_path):
    model = skewed_model(tmp_path / "model", "qwen3_moe")
    stack = start_run(model, tmp_path / "run", "--tensor-parallel", "2", "--enable-expert-parallel",
                      "--enable-eplb", "--eplb-config", json.dumps(EPLB), engines=1)
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=600) as http:
            for _ in range(2):  # the first batch's steps move the layers, the second's are measured after the moves
                outcomes = await asyncio.gather(*(complete(http, stack.model, p, TOKENS) for p in PROMPTS))
                assert all(o.completed for o in outcomes), outcomes
        found = eplb_samples(metrics_after(stack.url, 2 * TOKENS * len(PROMPTS)))
    finally:
        stack.kill()
    assert set(found["balancedness"]) == set(found["planned_balancedness"]) == {("0", "0"), ("0", "2")}, found
    assert min(found["balancedness"].values()) >= 0.9 and min(found["planned_balancedness"].values()) >= 0.9, found
    assert found["rearrangements_total"][("0",)] >= 1 and found["layers_moved_total"][("0",)] >= 2, found
    assert found["rearrangement_seconds_total"][("0",)] > 0, found
