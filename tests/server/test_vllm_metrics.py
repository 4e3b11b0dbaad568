"""``--metrics-compat vllm``: the ``vllm:`` series routers and autoscalers written for vLLM read.

The Gateway API Inference Extension's model-server protocol names, for vLLM, the gauges
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc`` (older
pickers ``vllm:gpu_cache_usage_perc``), and optionally ``vllm:cache_config_info``'s ``block_size`` and
``num_gpu_blocks`` labels; its picker reads the first series of each name. Here they must be present,
of the right type, one series each for the whole fleet, with vLLM's labels; and absent with ``none``.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from megatron_serve import InferenceConfig, MegatronAsyncLLM
from megatron_serve.wire.engine_stats import EngineStats
from megatron_serve.http_options import HTTPOptions
from megatron_serve.server import create_app
from megatron_serve.server.metric_catalog import VLLM_SERIES
from megatron_serve.server.metrics import ServerMetrics
from megatron_serve.server.vllm_metrics import VllmCollector

from .conftest import serving

pytestmark = pytest.mark.timeout(300)

# The Inference Extension's model-server protocol, vLLM column (docs/proposals/003-model-server-protocol):
# name -> type. TotalQueuedRequests, TotalRunningRequests, KVCacheUtilization; the older pickers' name.
PROTOCOL = {"vllm:num_requests_waiting": "gauge", "vllm:num_requests_running": "gauge",
            "vllm:kv_cache_usage_perc": "gauge", "vllm:gpu_cache_usage_perc": "gauge"}
OPTIONAL = {"vllm:cache_config_info": ("block_size", "num_gpu_blocks")}  # BlockSize, NumGPUBlocks (labels)


def families(text: str) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(family, suffix: str = "") -> list:
    return [s for s in family.samples if s.name == family.name + suffix]


class Fleet:
    """The monitor's view of a fleet: two engine groups with real heartbeat metrics, and a coordinator queue."""

    reachable = True
    state = "RUNNING"

    def __init__(self) -> None:
        stats = []
        for ttft in (0.03, 0.3):
            engine_stats = EngineStats()
            engine_stats.histograms["time_to_first_token_seconds"].observe(ttft)
            engine_stats.counters["prompt_tokens"] += 100
            stats.append(engine_stats.to_wire(prefix_cache_queries=50, prefix_cache_hits=20))
        self.engines = [
            {"id": f"e{g}", "group": g, "running": 2 + g, "waiting": 1, "kv_blocks_free": 30, "kv_blocks_total": 40,
             "info": {"block_size": 16}, "metrics": stats[g]} for g in (0, 1)]
        self.status = {"state": "RUNNING", "queued": 5, "in_flight": 7, "engines": self.engines}

    def totals(self) -> dict[str, int]:
        return {"engines": 2, "queued": 5, "in_flight": 7, "kv_blocks_used": 20, "kv_blocks_total": 80,
                "computed_tokens": 0}


def test_the_fleet_is_one_vllm_engine_to_a_router():
    fleet = Fleet()
    metrics = ServerMetrics(fleet, lambda: 0, "m")  # type: ignore[arg-type]
    metrics.registry.register(VllmCollector(fleet, metrics, "m"))  # type: ignore[arg-type]
    found = families(metrics.render()[0].decode())
    for name, kind in PROTOCOL.items():
        assert found[name].type == kind, name
        (sample,) = samples(found[name])  # one series: the picker reads the first, it must be the fleet
        assert sample.labels == {"model_name": "m", "engine": "0"}
    assert samples(found["vllm:num_requests_waiting"])[0].value == 1 + 1 + 5  # engines' queues + the coordinator's
    assert samples(found["vllm:num_requests_running"])[0].value == 2 + 3
    assert samples(found["vllm:kv_cache_usage_perc"])[0].value == pytest.approx(20 / 80)
    (info,) = samples(found["vllm:cache_config_info"])
    assert {label: info.labels[label] for label in OPTIONAL["vllm:cache_config_info"]} == {
        "block_size": "16", "num_gpu_blocks": "80"}
    assert samples(found["vllm:prompt_tokens"], "_total")[0].value == 200
    assert samples(found["vllm:prefix_cache_hits"], "_total")[0].value == 40
    ttft = {s.labels["le"]: s.value for s in samples(found["vllm:time_to_first_token_seconds"], "_bucket")}
    assert ttft["0.04"] == 1 and ttft["0.5"] == 2 and ttft["+Inf"] == 2  # both engines' observations
    exported = {name for name in found if name.startswith("vllm:")}
    assert exported == {entry.name.removesuffix("_total") for entry in VLLM_SERIES}


def test_lora_requests_info_is_the_fleets_adapters_as_vllm_labels_them():
    fleet = Fleet()
    metrics = ServerMetrics(fleet, lambda: 0, "m")  # type: ignore[arg-type]
    metrics.registry.register(VllmCollector(fleet, metrics, "m"))  # type: ignore[arg-type]
    assert samples(families(metrics.render()[0].decode())["vllm:lora_requests_info"]) == []  # no --enable-lora
    reports = ({"max_loras": 2, "running": ["sql"], "waiting": ["chat"]},
               {"max_loras": 2, "running": ["code", "sql"], "waiting": []})
    for engine, report, heartbeat in zip(fleet.engines, reports, (1.8e9, 1.8e9 + 5)):
        engine["metrics"]["lora"], engine["last_heartbeat"] = report, heartbeat
    (info,) = samples(families(metrics.render()[0].decode())["vllm:lora_requests_info"])
    assert info.labels == {"max_lora": "4", "running_lora_adapters": "code,sql", "waiting_lora_adapters": "chat"}
    assert info.value == 1.8e9 + 5  # the latest report's wall-clock time


async def test_metrics_compat_over_http_with_a_real_engine(tiny_model, tokenizer):
    settings = InferenceConfig(block_size_tokens=16, num_kv_blocks=64)
    async with MegatronAsyncLLM(tiny_model, settings) as llm:
        for compat in ("vllm", "none"):
            app = create_app(llm.client, tokenizer, "tiny-llama", status_interval=0.05,
                             options=HTTPOptions(metrics_compat=compat))
            async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
                answer = await http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "Hello there",
                                                                   "max_tokens": 3, "temperature": 0})
                assert answer.status_code == 200
                found = families((await http.get("/metrics")).text)
            if compat == "none":
                assert not [name for name in found if name.startswith("vllm:")]
                continue
            for name, kind in PROTOCOL.items():
                assert found[name].type == kind and len(samples(found[name])) == 1, name
            assert samples(found["vllm:cache_config_info"])[0].labels["block_size"] == "16"
            assert samples(found["vllm:generation_tokens"], "_total")[0].value >= 3
            assert samples(found["vllm:request_success"], "_total")  # labelled by finished_reason
            assert samples(found["vllm:request_time_per_output_token_seconds"], "_count")[0].value >= 1


async def test_stats_lines_while_busy_and_none_with_disable_log_stats(tiny_model, tokenizer, caplog):
    """vLLM's periodic stats line (here every ``stats_interval``; 10 s by default) and ``--disable-log-stats``."""
    caplog.set_level(logging.INFO, logger="megatron_serve.stats")
    settings = InferenceConfig(block_size_tokens=16, num_kv_blocks=64)
    async with MegatronAsyncLLM(tiny_model, settings) as llm:
        for enabled in (True, False):
            caplog.clear()
            app = create_app(llm.client, tokenizer, "tiny-llama", status_interval=0.02,
                             options=HTTPOptions(log_stats=enabled, stats_interval=0.05))
            async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
                answer = await http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "Hello there",
                                                                   "max_tokens": 4, "temperature": 0})
                assert answer.status_code == 200
                monitor = app.state.ctx.monitor
                polls, last = 0, monitor.updated
                deadline = asyncio.get_running_loop().time() + 60
                while polls < 20:  # twenty fresh statuses: several stats intervals went by
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.01)
                    if monitor.updated != last:
                        polls, last = polls + 1, monitor.updated
            lines = [r.getMessage() for r in caplog.records if r.name == "megatron_serve.stats"]
            if not enabled:
                assert lines == []
                continue
            assert any("avg generation throughput" in line and "generation throughput 0.0" not in line
                       for line in lines), lines  # the interval with the request in it
            assert "running 0 reqs, waiting 0 reqs" in lines[-1]  # one last line once idle, then none
