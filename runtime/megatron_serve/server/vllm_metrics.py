"""``--metrics-compat vllm``: the ``vllm:`` series that routers and autoscalers written for vLLM read.

The Gateway API Inference Extension's endpoint picker (and llm-d's scheduler and KServe's
LLMInferenceService, built on it) reads ``vllm:num_requests_waiting``, ``vllm:num_requests_running``
and ``vllm:kv_cache_usage_perc`` from each endpoint it balances, as gauges, and optionally
``vllm:cache_config_info``'s ``block_size`` / ``num_gpu_blocks`` labels; the vLLM production-stack
router and KEDA triggers copied from vLLM guides read the same names (older routers
``vllm:gpu_cache_usage_perc``). Each endpoint is a server here, and behind a server stands a whole
fleet: a picker reads the first series of a name, so a fleet must be one series, not one per engine
group. Every series here therefore describes the fleet as one vLLM engine (``engine="0"``):

* gauges and counters are summed over the engine groups; the waiting count includes the requests
  queued at the coordinator (they wait too); KV-cache usage is used / total blocks of all groups;
* histograms are summed bucket by bucket (every engine has the same bounds);
* ``vllm:request_time_per_output_token_seconds`` is this server's own histogram, renamed;
* ``vllm:lora_requests_info`` (engines with ``--enable-lora``): the adapters of the running and of the
  waiting requests of all groups, the slots of all groups as ``max_lora``, valued with the wall-clock
  time of the latest engine report, as vLLM values it with the time of its latest step. Requests still
  queued at the coordinator are not among the waiting adapters (the engines report what they hold).

The per-group detail stays in the ``megatron_serve_`` series. A counter summed over groups drops
when a group restarts; Prometheus's ``rate`` reads that as a counter reset, as for a restarted vLLM.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .fleet import FleetMonitor
from .metric_catalog import VLLM_SERIES, VllmSeries, series
from .metrics import read_engine

if TYPE_CHECKING:
    from .metrics import ServerMetrics

ENGINE_INDEX = "0"


def _family(entry: VllmSeries) -> Metric:
    cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}[entry.kind]
    name = entry.name.removesuffix("_total") if entry.kind == "counter" else entry.name
    return cls(name, entry.help, labels=list(entry.labels))


def _add_buckets(into: dict[str, float], buckets: list[tuple[str, float]]) -> None:
    for bound, count in buckets:
        into[bound] = into.get(bound, 0.0) + count


class VllmCollector(Collector):
    """The ``vllm:`` series of :data:`~.metric_catalog.VLLM_SERIES`, for the fleet as one engine."""

    def __init__(self, monitor: FleetMonitor, metrics: "ServerMetrics", model_name: str) -> None:
        self.monitor = monitor
        self.metrics = metrics
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        labels = [self.model_name, ENGINE_INDEX]
        engines = self.monitor.engines if self.monitor.reachable else []
        values: dict[str, dict[tuple[str, ...], float]] = {}
        histograms: dict[str, tuple[dict[str, float], float]] = {}
        for engine in engines:
            reading = read_engine(engine)
            for name, by_labels in reading.values.items():
                summed = values.setdefault(name, {})
                for extra, value in by_labels.items():
                    summed[extra] = summed.get(extra, 0.0) + value
            for name, (buckets, total) in reading.histograms.items():
                counts, known = histograms.get(name, ({}, 0.0))
                _add_buckets(counts, buckets)
                histograms[name] = (counts, known + total)
        totals = self.monitor.totals()
        if engines:
            waiting = sum(values.get("num_requests_waiting", {}).values()) + totals["queued"]
            values["num_requests_waiting"] = {(): waiting}
            used, total = totals["kv_blocks_used"], totals["kv_blocks_total"]
            values["kv_cache_usage_perc"] = {(): used / total if total else 0.0}
        for name, pairs in self._server_histograms().items():
            histograms[name] = pairs
        for entry in VLLM_SERIES:
            family = _family(entry)
            if entry.name == "vllm:lora_requests_info":
                self._lora_info(family, engines)
            elif entry.twin is None:
                self._cache_config(family, labels, engines)
            elif series(entry.twin).kind == "histogram":
                if entry.twin in histograms:
                    counts, total = histograms[entry.twin]
                    family.add_metric(labels, list(counts.items()), total)
            else:
                for extra, value in sorted(values.get(entry.twin, {}).items()):
                    family.add_metric([*labels, *extra], value)
            yield family

    def _server_histograms(self) -> dict[str, tuple[dict[str, float], float]]:
        """This server's own histograms (time per output token), as cumulative buckets and a sum."""
        found: dict[str, tuple[dict[str, float], float]] = {}
        tpot = series("time_per_output_token_seconds")
        for metric in self.metrics.own_series():
            if metric.name != tpot.full_name:
                continue
            counts = {s.labels["le"]: s.value for s in metric.samples if s.name.endswith("_bucket")}
            total = sum(s.value for s in metric.samples if s.name.endswith("_sum"))
            found[tpot.name] = (counts, total)
        return found

    @staticmethod
    def _cache_config(family: Metric, labels: list[str], engines: list[dict]) -> None:
        sizes = {engine.get("info", {}).get("block_size") for engine in engines}
        sizes = {size for size in sizes if isinstance(size, int) and not isinstance(size, bool) and size > 0}
        if len(sizes) != 1:
            return  # no engine yet, or groups that disagree: no single block size to report
        blocks = sum(int(engine.get("kv_blocks_total") or 0) for engine in engines)
        family.add_metric([*labels, str(sizes.pop()), str(blocks)], 1.0)

    @staticmethod
    def _lora_info(family: Metric, engines: list[dict]) -> None:
        """vLLM's one series: the adapters of every engine group's running and waiting requests together (the
        fleet is one engine), the slots of all groups, valued with the latest report's wall-clock time."""
        reports = [(engine, engine["metrics"]["lora"]) for engine in engines
                   if isinstance(engine.get("metrics"), dict) and isinstance(engine["metrics"].get("lora"), dict)]
        if not reports:
            return  # no engine with --enable-lora: vLLM exports no series either
        slots = sum(int(report.get("max_loras") or 0) for _, report in reports)
        running = sorted({str(n) for _, report in reports for n in report.get("running") or []})
        waiting = sorted({str(n) for _, report in reports for n in report.get("waiting") or []})
        latest = max(float(engine.get("last_heartbeat") or time.time()) for engine, _ in reports)
        family.add_metric([str(slots), ",".join(waiting), ",".join(running)], latest)
