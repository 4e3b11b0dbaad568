"""Prometheus metrics of one server: its own counters and histograms, plus fleet gauges from STATUS.

Each app gets its own ``CollectorRegistry`` so that several apps (tests, ``serve()`` next to a
``run``) never share or double-register series. Request-level series (outcomes, tokens, TTFT,
TPOT) are observed by this server; fleet-level gauges (queue depth, running requests, KV blocks,
lifecycle state) are read from the coordinator's last ``STATUS_REPLY`` at scrape time, so every
server replica in front of one fleet reports the same fleet numbers.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .fleet import FleetMonitor

LIFECYCLE_STATES = ("RUNNING", "PAUSED", "SUSPENDED", "STOPPED")
_PREFIX = "megatron_serve"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5)
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0)


class _FleetCollector(Collector):
    """Gauges computed from the monitor's last status and the server's own pending count."""

    def __init__(self, monitor: FleetMonitor, pending: Callable[[], int]) -> None:
        self.monitor = monitor
        self.pending = pending

    def collect(self) -> Iterable[GaugeMetricFamily]:
        monitor = self.monitor
        totals = monitor.totals()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{_PREFIX}_{name}", doc, value=value)

        yield gauge("coordinator_reachable", "1 while the coordinator answers STATUS", 1.0 if monitor.reachable else 0.0)
        state = GaugeMetricFamily(f"{_PREFIX}_lifecycle_state", "1 for the fleet's current lifecycle state",
                                  labels=["state"])
        current = monitor.state if monitor.reachable else None
        for name in LIFECYCLE_STATES:
            state.add_metric([name], 1.0 if current == name else 0.0)
        yield state
        yield gauge("engines", "engine groups registered with the coordinator", totals["engines"])
        yield gauge("queue_depth", "requests queued at the coordinator, not yet sent to an engine", totals["queued"])
        yield gauge("requests_in_flight", "requests the coordinator has sent to engines", totals["in_flight"])
        yield gauge("requests_running", "requests running in engines (their last heartbeat)", totals["running"])
        yield gauge("requests_waiting", "requests waiting inside engines (their last heartbeat)", totals["waiting"])
        yield gauge("kv_blocks_used", "KV cache blocks in use, all engines", totals["kv_blocks_used"])
        yield gauge("kv_blocks_total", "KV cache blocks, all engines", totals["kv_blocks_total"])
        yield gauge("engine_cached_tokens", "prompt tokens the engines skipped thanks to their prefix caches "
                    "(sum of the engines' counters since they started)", totals["cached_tokens"])
        yield gauge("engine_computed_tokens", "tokens the engines ran through the model, prefill and decode "
                    "(sum of the engines' counters since they started)", totals["computed_tokens"])
        yield gauge("server_pending_requests", "engine requests this server is waiting on", self.pending())
        yield from _refit_metrics(monitor)


def _refit_metrics(monitor: FleetMonitor) -> Iterable[GaugeMetricFamily]:
    """Weights generation of the fleet and of each engine, and how long each engine's last refit took."""
    status = monitor.status or {}
    yield GaugeMetricFamily(f"{_PREFIX}_weights_epoch", "generation (REFIT epoch) of the weights the fleet serves",
                            value=float(status.get("epoch") or 0))
    yield CounterMetricFamily(f"{_PREFIX}_refits", "REFITs the coordinator completed since it started",
                              value=float(status.get("refits") or 0))
    epochs = GaugeMetricFamily(f"{_PREFIX}_engine_weights_epoch", "generation of the weights each engine serves",
                               labels=["engine", "group"])
    seconds = GaugeMetricFamily(f"{_PREFIX}_engine_refit_seconds", "duration of each engine's last refit, by phase "
                                "(verify: shape check; load: copying weights in place; total)",
                                labels=["engine", "group", "phase"])
    for engine in monitor.engines:
        labels = [str(engine.get("id")), str(engine.get("group"))]
        if isinstance(engine.get("epoch"), int):
            epochs.add_metric(labels, float(engine["epoch"]))
        for phase, value in ((engine.get("last_refit") or {}).items()):
            if phase.endswith("_s") and isinstance(value, (int, float)):
                seconds.add_metric([*labels, phase[:-2]], float(value))
    yield epochs
    yield seconds


class _HitRateCollector(Collector):
    """Prefix-cache hit rate of this server's finished requests: cached / prompt tokens (0 before any)."""

    def __init__(self, metrics: "ServerMetrics") -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[GaugeMetricFamily]:
        m = self.metrics
        rate = m._cached_total / m._prompt_total if m._prompt_total else 0.0
        yield GaugeMetricFamily(f"{_PREFIX}_prefix_cache_hit_rate",
                                "cached prompt tokens / prompt tokens of the requests this server finished", value=rate)


class ServerMetrics:
    """The series of one server (see the module docstring)."""

    def __init__(self, monitor: FleetMonitor, pending: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(f"{_PREFIX}_http_requests", "HTTP requests answered, by route and status code",
                                     ["route", "code"], registry=r)
        self.requests = Counter(f"{_PREFIX}_requests", "generation requests by outcome: completed, failed, aborted",
                                ["status"], registry=r)
        self.finish_reasons = Counter(f"{_PREFIX}_finish_reasons", "completed choices by finish reason",
                                      ["reason"], registry=r)
        self.prompt_tokens = Counter(f"{_PREFIX}_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter(f"{_PREFIX}_cached_prompt_tokens",
                                            "prompt tokens of finished requests served from the prefix cache",
                                            registry=r)
        self._prompt_total = 0  # the two counters' values, for the hit rate
        self._cached_total = 0
        self.generation_tokens = Counter(f"{_PREFIX}_generation_tokens", "tokens generated for finished requests",
                                         registry=r)
        self.ttft = Histogram(f"{_PREFIX}_time_to_first_token_seconds", "time from arrival to the first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{_PREFIX}_time_per_output_token_seconds",
                              "mean time between generated tokens after the first", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{_PREFIX}_e2e_request_latency_seconds", "time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        for status in ("completed", "failed", "aborted"):
            self.requests.labels(status)  # present from the start, so rates work from the first scrape
        for reason in ("stop", "length"):
            self.finish_reasons.labels(reason)
        self.registry.register(_FleetCollector(monitor, pending))
        self.registry.register(_HitRateCollector(self))

    def observe_finished(self, request: Any) -> None:
        """Count one finished engine request (a ``DynamicInferenceRequest``)."""
        status = getattr(request, "status", None)
        status = getattr(status, "value", status)
        reason = getattr(request, "finish_reason", None)
        reason = getattr(reason, "value", reason)
        if reason == "abort":
            self.requests.labels("aborted").inc()
        elif status == "COMPLETED":
            self.requests.labels("completed").inc()
            if reason in ("stop", "length"):
                self.finish_reasons.labels(reason).inc()
        else:
            self.requests.labels("failed").inc()
        generated = len(getattr(request, "generated_tokens", []) or [])
        prompt = len(getattr(request, "prompt_tokens", []) or [])
        cached = min(int(getattr(request, "cached_tokens", 0) or 0), prompt)
        self.prompt_tokens.inc(prompt)
        self.cached_prompt_tokens.inc(cached)
        self._prompt_total += prompt
        self._cached_total += cached
        self.generation_tokens.inc(generated)
        ttft, latency = getattr(request, "ttft", None), getattr(request, "latency", None)
        if ttft is not None and ttft >= 0:
            self.ttft.observe(ttft)
        if latency is not None and latency >= 0:
            self.e2e.observe(latency)
            if ttft is not None and generated > 1 and latency >= ttft:
                self.tpot.observe((latency - ttft) / (generated - 1))

    def observe_aborted(self, count: int = 1) -> None:
        """Requests this server aborted (its client went away) before they finished."""
        self.requests.labels("aborted").inc(count)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
