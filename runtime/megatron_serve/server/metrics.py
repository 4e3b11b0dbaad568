"""Prometheus metrics of one server: its own counters, plus the fleet's and every engine's series from STATUS.

Each app gets its own ``CollectorRegistry`` so that several apps (tests, ``serve()`` next to a
``run``) never share or double-register series. Every series is declared in
:mod:`.metric_catalog` (name, type, labels, meaning, vLLM twin); this module only fills them in:

* request-level series of this server (outcomes, TPOT, cached prompt tokens) are observed here;
* fleet gauges (queue depth, KV blocks, lifecycle state, refits) and the engine series (vLLM's
  running/waiting, KV-cache usage, token counters, TTFT/ITL/latency/queue histograms, preemptions,
  prefix-cache queries and hits) are read from the coordinator's last ``STATUS_REPLY`` at scrape
  time. Engines ship cumulative numbers in their heartbeats, so a scrape costs the engines nothing
  and one scrape of any server sees the whole fleet.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..wire.engine_stats import (ACCEPTED_PER_POS, COUNTERS, EPLB, FINISH_REASONS, HISTOGRAMS, KV_DISK,
                                 KV_DISK_OPERATIONS, KV_OFFLOAD, KV_OFFLOAD_DIRECTIONS, KV_TRANSFER,
                                 KV_TRANSFER_DIRECTIONS)
from ..wire.lifecycle import FleetState
from .fleet import FleetMonitor
from .metric_catalog import SERIES, Series, series


_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5)


def _family(name: str, value: float | None = None) -> Metric:
    """An empty (or single-valued) family for the catalogue entry ``name``."""
    entry = series(name)
    cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}[entry.kind]
    if value is not None:
        return cls(entry.base_name, entry.help, value=value)
    return cls(entry.base_name, entry.help, labels=list(entry.labels))


#: Prometheus' own switch for its multiprocess mode: set (by ``--api-server-count`` N > 1) to the directory of
#: the files where each API server process keeps its series; a scrape of any process sums them all.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def group_label(engine: dict[str, Any]) -> str:
    """The ``engine_group`` label of an engine's series: its group, and its rank there under data-parallel attention
    (``0-dp1``), whose ranks are engines of their own sharing a group (one series each)."""
    rank = (engine.get("info") or {}).get("data_parallel_rank")
    return str(engine.get("group")) + (f"-dp{rank}" if rank is not None else "")


class _FleetCollector(Collector):
    """Fleet gauges from the monitor's last status, and the server's own pending count (None: a multiprocess
    gauge has it)."""

    def __init__(self, monitor: FleetMonitor, pending: Callable[[], int] | None) -> None:
        self.monitor = monitor
        self.pending = pending

    def collect(self) -> Iterable[Metric]:
        monitor = self.monitor
        totals = monitor.totals()
        yield _family("coordinator_reachable", 1.0 if monitor.reachable else 0.0)
        state = _family("lifecycle_state")
        current = monitor.state if monitor.reachable else None
        for name in FleetState:
            state.add_metric([name.value], 1.0 if current == name.value else 0.0)
        yield state
        yield _family("engines", totals["engines"])
        yield _family("queue_depth", totals["queued"])
        yield _family("requests_in_flight", totals["in_flight"])
        yield _family("kv_blocks_used", totals["kv_blocks_used"])
        yield _family("kv_blocks_total", totals["kv_blocks_total"])
        yield _family("engine_computed_tokens", totals["computed_tokens"])
        if self.pending is not None:
            yield _family("server_pending_requests", self.pending())
        yield from _refit_metrics(monitor)


def _refit_metrics(monitor: FleetMonitor) -> Iterable[Metric]:
    """Weights generation of the fleet and of each engine, and how long each engine's last refit took."""
    status = monitor.status or {}
    yield _family("weights_epoch", float(status.get("epoch") or 0))
    yield _family("refits_total", float(status.get("refits") or 0))
    epochs = _family("engine_weights_epoch")
    seconds = _family("engine_refit_seconds")
    for engine in monitor.engines:
        labels = [str(engine.get("id")), str(engine.get("group"))]
        if isinstance(engine.get("epoch"), int):
            epochs.add_metric(labels, float(engine["epoch"]))
        for phase, value in ((engine.get("last_refit") or {}).items()):
            if phase.endswith("_s") and isinstance(value, (int, float)):
                seconds.add_metric([*labels, phase[:-2]], float(value))
    yield epochs
    yield seconds


def reported_number(value: Any) -> float | None:
    """A finite, non-negative number from an engine's report (None for anything else: never a broken scrape)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


def reported_buckets(report: Any, bounds: tuple[float, ...]) -> tuple[list[tuple[str, float]], float] | None:
    """Cumulative ``(le, count)`` pairs and the sum of one reported histogram, if it is well formed."""
    if not isinstance(report, dict) or not isinstance(report.get("counts"), list):
        return None
    counts = [reported_number(c) for c in report["counts"]]
    total = reported_number(report.get("sum"))
    if report.get("le") != list(bounds) or len(counts) != len(bounds) + 1 or None in counts or total is None:
        return None  # another version's bounds, or garbage: leave this engine's histogram out
    pairs, running = [], 0.0
    for bound, count in zip([*map(str, bounds), "+Inf"], counts):
        running += count  # type: ignore[operator]
        pairs.append((bound, running))
    return pairs, total


@dataclass
class EngineReading:
    """One engine's series from its last report (a ``STATUS_REPLY`` engine entry), before any labels.

    ``values``: gauge and counter series by catalogue name -> (their labels beyond the engine's, e.g.
    a finish reason) -> value; ``histograms``: by name -> (cumulative ``(le, count)`` pairs, sum).
    Anything missing or malformed is left out: an engine of another version never breaks a scrape.
    """

    values: dict[str, dict[tuple[str, ...], float]] = field(default_factory=dict)
    histograms: dict[str, tuple[list[tuple[str, float]], float]] = field(default_factory=dict)

    def put(self, name: str, value: float | None, *labels: str) -> None:
        if value is not None:
            self.values.setdefault(name, {})[labels] = value


def read_engine(engine: dict[str, Any]) -> EngineReading:
    """The engine series of one engine entry of ``STATUS_REPLY``."""
    reading = EngineReading()
    reading.put("num_requests_running", reported_number(engine.get("running")))
    reading.put("num_requests_waiting", reported_number(engine.get("waiting")))
    free, total = reported_number(engine.get("kv_blocks_free")), reported_number(engine.get("kv_blocks_total"))
    if free is not None and total:
        reading.put("kv_cache_usage_perc", min(max(1.0 - free / total, 0.0), 1.0))
    report = engine.get("metrics")
    if not isinstance(report, dict):
        return reading  # an engine that reports no metrics (an older version, or not yet)
    counters = report.get("counters") if isinstance(report.get("counters"), dict) else {}
    for name in COUNTERS:
        reading.put(f"{name}_total", reported_number(counters.get(name)))
    finished = report.get("request_success") if isinstance(report.get("request_success"), dict) else {}
    for reason in FINISH_REASONS:
        reading.put("request_success_total", reported_number(finished.get(reason)), reason)
    per_pos = report.get(ACCEPTED_PER_POS) if isinstance(report.get(ACCEPTED_PER_POS), dict) else {}
    for position, count in per_pos.items():
        if isinstance(position, str) and position.isdigit():
            reading.put(f"{ACCEPTED_PER_POS}_total", reported_number(count), position)
    offload = report.get(KV_OFFLOAD) if isinstance(report.get(KV_OFFLOAD), dict) else {}
    for direction in KV_OFFLOAD_DIRECTIONS:
        copies = offload.get(direction) if isinstance(offload.get(direction), dict) else {}
        reading.put("kv_offload_total_bytes_total", reported_number(copies.get("bytes")), direction)
        reading.put("kv_offload_total_time_total", reported_number(copies.get("seconds")), direction)
    transfers = report.get(KV_TRANSFER) if isinstance(report.get(KV_TRANSFER), dict) else {}
    for direction in KV_TRANSFER_DIRECTIONS:
        moved = transfers.get(direction) if isinstance(transfers.get(direction), dict) else {}
        reading.put("kv_transfers_total", reported_number(moved.get("transfers")), direction)
        reading.put("kv_transfer_bytes_total", reported_number(moved.get("bytes")), direction)
    disk = report.get(KV_DISK)
    if isinstance(disk, dict):
        read_kv_disk(reading, disk)
    eplb = report.get(EPLB)
    if isinstance(eplb, dict):
        read_eplb(reading, eplb)
    histograms = report.get("histograms") if isinstance(report.get("histograms"), dict) else {}
    for name, bounds in HISTOGRAMS.items():
        parsed = reported_buckets(histograms.get(name), bounds)
        if parsed is not None:
            reading.histograms[name] = parsed
    return reading


#: the disk tier's unlabelled series and their keys in ``metrics["kv_disk"]``
_KV_DISK_SERIES = (("kv_disk_usage_bytes", "usage_bytes"), ("kv_disk_blocks", "files"),
                   ("kv_disk_blocks_written_total", "written"), ("kv_disk_hits_total", "hits"),
                   ("kv_disk_misses_total", "misses"), ("kv_disk_corrupt_total", "corrupt"),
                   ("kv_disk_evictions_total", "evicted"), ("kv_disk_dropped_writes_total", "dropped"))


def read_kv_disk(reading: EngineReading, disk: dict[str, Any]) -> None:
    """The disk KV tier's series of one engine (``metrics["kv_disk"]``, engines with ``--kv-offloading-backend
    disk`` only)."""
    for name, key in _KV_DISK_SERIES:
        reading.put(name, reported_number(disk.get(key)))
    for operation in KV_DISK_OPERATIONS:
        reading.put("kv_disk_errors_total", reported_number(disk.get(f"{operation}_errors")), operation)
        reading.put("kv_disk_io_bytes_total", reported_number(disk.get(f"{operation}_bytes")), operation)


def read_eplb(reading: EngineReading, eplb: dict[str, Any]) -> None:
    """EPLB's series of one engine (``metrics["eplb"]``): per-layer balancedness where a window was measured, and the
    counts."""
    reading.put("eplb_rearrangements_total", reported_number(eplb.get("rearrangements")))
    reading.put("eplb_layers_moved_total", reported_number(eplb.get("layers_moved")))
    reading.put("eplb_rearrangement_seconds_total", reported_number(eplb.get("seconds")))
    layers = eplb.get("layers") if isinstance(eplb.get("layers"), list) else []
    for name, key in (("eplb_balancedness", "measured"), ("eplb_planned_balancedness", "planned")):
        values = eplb.get(key)
        if isinstance(values, list) and len(values) == len(layers):
            for layer, value in zip(layers, values):
                if isinstance(layer, int) and not isinstance(layer, bool):
                    reading.put(name, reported_number(value), str(layer))


class _EngineCollector(Collector):
    """vLLM's engine series, one per engine group, from the ``metrics`` each engine last reported."""

    def __init__(self, monitor: FleetMonitor, model_name: str) -> None:
        self.monitor = monitor
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        engines = self.monitor.engines if self.monitor.reachable else []
        families = {s.name: _family(s.name) for s in SERIES if s.source == "engine"}
        for engine in engines:
            labels = [group_label(engine), self.model_name]
            reading = read_engine(engine)
            for name, by_labels in reading.values.items():
                for extra, value in by_labels.items():
                    families[name].add_metric([*labels, *extra], value)
            for name, (buckets, total) in reading.histograms.items():
                families[name].add_metric(labels, buckets, total)
        yield from families.values()
        yield from (_colon_twin(s, families[s.name]) for s in SERIES if s.source == "engine" and s.colon_twin)


def _colon_twin(entry: Series, family: Metric) -> Metric:
    """``family`` again under ``megatron:<name>`` (its samples renamed, values and labels unchanged)."""
    assert entry.colon_name is not None
    base = entry.colon_name.removesuffix("_total") if entry.kind == "counter" else entry.colon_name
    twin = Metric(base, entry.help, family.type)
    twin.samples = [sample._replace(name=base + sample.name[len(family.name):]) for sample in family.samples]
    return twin


class _HitRateCollector(Collector):
    """Prefix-cache hit rate of this server's finished requests: cached / prompt tokens (0 before any)."""

    def __init__(self, metrics: "ServerMetrics") -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        cached, prompt = (self.metrics.sample_total(name) for name in ("cached_prompt_tokens_total",
                                                                        "finished_prompt_tokens_total"))
        yield _family("prefix_cache_hit_rate", cached / prompt if prompt else 0.0)


def _counter(entry: Series, registry: CollectorRegistry) -> Counter:
    return Counter(entry.base_name, entry.help, list(entry.labels), registry=registry)


class ServerMetrics:
    """The series of one server (see the module docstring).

    With ``$PROMETHEUS_MULTIPROC_DIR`` set (``--api-server-count`` N > 1), the server's own series live in
    that directory's files, one per process, and :meth:`render` sums them over the processes; the pending
    count is then a live-sum gauge that each process updates as it changes.
    """

    def __init__(self, monitor: FleetMonitor, pending: Callable[[], int], model_name: str = "") -> None:
        self.shared_dir = os.environ.get(MULTIPROC_ENV) or None
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = _counter(series("http_requests_total"), r)
        self.requests = _counter(series("requests_total"), r)
        self.finish_reasons = _counter(series("finish_reasons_total"), r)
        self.cached_prompt_tokens = _counter(series("cached_prompt_tokens_total"), r)
        self.finished_prompt_tokens = _counter(series("finished_prompt_tokens_total"), r)
        tpot = series("time_per_output_token_seconds")
        self.tpot = Histogram(tpot.base_name, tpot.help, buckets=_TPOT_BUCKETS, registry=r)
        # Present from the start, so rates work from the first scrape; kept, so that counting one is no lookup of
        # its labels (``labels()`` checks and joins them each time: a few us per request).
        self._by_status = {status: self.requests.labels(status) for status in ("completed", "failed", "aborted")}
        self._by_reason = {reason: self.finish_reasons.labels(reason) for reason in ("stop", "length")}
        self._http: dict[tuple[str, int], Any] = {}  # (route, status) -> its child of http_requests
        self.tenant_series: _TenantSeries | None = None  # made by enable_tenants (a server with tenants)
        self.pending_gauge: Gauge | None = None
        if self.shared_dir is not None:
            entry = series("server_pending_requests")
            self.pending_gauge = Gauge(entry.base_name, entry.help, registry=r, multiprocess_mode="livesum")
        self.collectors: list[Collector] = [_FleetCollector(monitor, None if self.shared_dir else pending),
                                            _EngineCollector(monitor, model_name), _HitRateCollector(self)]
        for collector in self.collectors:
            self.registry.register(collector)

    def add_collector(self, collector: Collector) -> None:
        """Series made at scrape time from the fleet's status (never summed over processes)."""
        self.collectors.append(collector)
        self.registry.register(collector)

    def own_series(self) -> list[Metric]:
        """This server's own series: this process's, or with several processes their sums."""
        if self.shared_dir is None:
            return [m for c in (self.http_requests, self.requests, self.finish_reasons, self.cached_prompt_tokens,
                                self.finished_prompt_tokens, self.tpot, *(self.tenant_series.all if self.tenant_series
                                                                                   else ())) for m in c.collect()]
        from prometheus_client.multiprocess import MultiProcessCollector  # noqa: PLC0415

        return list(MultiProcessCollector(None, path=self.shared_dir).collect())

    def sample_total(self, name: str, families: list[Metric] | None = None) -> float:
        """The sum of the samples of the series ``name`` (catalogue name) over its labels and processes."""
        full = series(name).full_name
        return sum(s.value for m in (families or self.own_series()) for s in m.samples if s.name == full)

    def observe_finished(self, request: Any) -> None:
        """Count one finished engine request (a ``DynamicInferenceRequest``)."""
        status = getattr(request, "status", None)
        status = getattr(status, "value", status)
        reason = getattr(request, "finish_reason", None)
        reason = getattr(reason, "value", reason)
        if reason == "abort":
            self._by_status["aborted"].inc()
        elif status == "COMPLETED":
            self._by_status["completed"].inc()
            if reason in ("stop", "length"):
                self._by_reason[reason].inc()
        else:
            self._by_status["failed"].inc()
        generated = len(getattr(request, "generated_tokens", []) or [])
        prompt = len(getattr(request, "prompt_tokens", []) or [])
        cached = min(int(getattr(request, "cached_tokens", 0) or 0), prompt)
        self.cached_prompt_tokens.inc(cached)
        self.finished_prompt_tokens.inc(prompt)
        ttft, latency = getattr(request, "ttft", None), getattr(request, "latency", None)
        if ttft is not None and latency is not None and generated > 1 and latency >= ttft >= 0:
            self.tpot.observe((latency - ttft) / (generated - 1))

    def enable_tenants(self) -> None:
        """Export the per-tenant series (a server with tenants; the others never show them)."""
        if self.tenant_series is None:
            self.tenant_series = _TenantSeries(self.registry)

    def observe_tenant_request(self, labels: tuple[str, str], request: Any) -> None:
        """One finished engine request of a tenant (``labels``: its name and class)."""
        if self.tenant_series is not None:
            self.tenant_series.observe(labels, request)

    def count_tenant_refusal(self, labels: tuple[str, str], reason: str) -> None:
        """A tenant's request refused before it started (429 over a limit, 503 shed)."""
        if self.tenant_series is not None:
            self.tenant_series.refused.labels(*labels, reason).inc()

    def observe_aborted(self, count: int = 1) -> None:
        """Requests this server aborted (its client went away) before they finished."""
        self._by_status["aborted"].inc(count)

    def observe_failed(self) -> None:
        """An engine request refused or lost on the way: no record came back."""
        self._by_status["failed"].inc()

    def observe_http(self, route: str, status: int) -> None:
        """One HTTP answer of ``route`` (its template, or ``unmatched``) with ``status``."""
        child = self._http.get((route, status))
        if child is None:
            child = self._http[(route, status)] = self.http_requests.labels(route, str(status))
        child.inc()

    def render(self) -> tuple[bytes, str]:
        if self.shared_dir is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        from prometheus_client.multiprocess import MultiProcessCollector  # noqa: PLC0415

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.shared_dir)
        for collector in self.collectors:
            registry.register(collector)
        return generate_latest(registry), CONTENT_TYPE_LATEST


class _TenantSeries:
    """The per-tenant series (docs/tenants.md), made once per server; none is exported before a tenant's first
    request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = _counter(series("tenant_requests_total"), registry)
        self.prompt_tokens = _counter(series("tenant_prompt_tokens_total"), registry)
        self.generation_tokens = _counter(series("tenant_generation_tokens_total"), registry)
        self.preemptions = _counter(series("tenant_num_preemptions_total"), registry)
        self.refused = _counter(series("tenant_requests_refused_total"), registry)
        queue = series("tenant_request_queue_time_seconds")
        self.queue_time = Histogram(queue.base_name, queue.help, list(queue.labels),
                                    buckets=HISTOGRAMS["request_queue_time_seconds"], registry=registry)
        self.all = (self.requests, self.prompt_tokens, self.generation_tokens, self.preemptions, self.refused,
                    self.queue_time)

    def observe(self, labels: tuple[str, str], request: Any) -> None:
        self.requests.labels(*labels).inc()
        self.prompt_tokens.labels(*labels).inc(len(getattr(request, "prompt_tokens", ()) or ()))
        self.generation_tokens.labels(*labels).inc(len(getattr(request, "generated_tokens", ()) or ()))
        events = getattr(request, "events", ()) or ()
        preempted = sum(1 for event in events if event.type.value == "PREEMPT")
        if preempted:
            self.preemptions.labels(*labels).inc(preempted)
        scheduled = next((event.timestamp for event in events if event.type.value == "PREFILL"), None)
        arrival = getattr(request, "arrival_time", None)
        if scheduled is not None and arrival is not None:
            self.queue_time.labels(*labels).observe(max(scheduled - arrival, 0.0))
