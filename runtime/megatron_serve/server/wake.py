"""Scale from zero: a request that finds no engine registered waits here for one, bounded, and says it waits.

Off unless ``--scale-from-zero-timeout`` is above 0 (vLLM has no engine-less server; a fleet that is not meant to
scale to zero should say it is not ready rather than hold requests for an engine nobody brings back).

A fleet scaled to zero engine groups (KEDA's ``minReplicaCount: 0``, ``kubectl scale mi --replicas=0``) keeps its
coordinator and this server. Before, a request then went to the coordinator's queue and waited there without a
limit or an end, and nothing the autoscaler reads asked for a group (the coordinator's queue depth counts requests
of registered engines' fleets, and a client that gave up left nothing behind). Now, while the fleet RUNS and no
engine is registered:

- a request is held here, at most ``queue`` of them at once (past it: 503 ``no_engine`` with ``Retry-After``);
- each for at most ``timeout`` seconds (past it: the same 503; the request never reached the coordinator);
- ``megatron_serve_requests_waiting_for_engine`` counts them and ``megatron_serve_engine_groups_wanted`` is 1 while
  any waits (the desired-replicas hint an HPA or KEDA reads to bring the first group back, docs/kubernetes/
  autoscaling.md);
- once an engine registers, every held request goes on as if it had just arrived, and
  ``megatron_serve_wake_seconds`` observes how long the first of them waited.

A paused or suspended fleet, or one whose engines are all draining, is not asleep: its requests wait at the
coordinator as before (a rollout or an RL step, not a fleet scaled to zero).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..http_options import WakeOptions
from .errors import APIError
from .fleet import FleetMonitor
from .metric_catalog import series

#: ``megatron_serve_wake_seconds``' buckets: a model load is seconds to minutes.
WAKE_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class WakeGate:
    """Holds requests while the fleet has no engine (see the module); one per server process."""

    def __init__(self, monitor: FleetMonitor, options: WakeOptions) -> None:
        self.monitor = monitor
        self.options = options
        self.waiting = 0
        self.since: float | None = None  # when the first of the requests waiting now arrived
        self.wake_buckets = [0] * len(WAKE_BUCKETS)  # wakes that took at most each bound (the histogram)
        self.wake_count = 0
        self.wake_sum = 0.0

    def asleep(self) -> bool:
        return self.options.enabled and self.monitor.asleep()

    def holds(self) -> bool:
        """Whether a request arriving now would be held (on, asleep, room in the queue): ``/ready`` is then 200,
        since the server takes the request and serves it once an engine registers."""
        return self.asleep() and self.waiting < self.options.queue

    def full(self) -> str | None:
        """Why a request arriving now is refused although the fleet is asleep and holding is on, or None."""
        if self.asleep() and self.waiting >= self.options.queue:
            return f"{self.waiting} requests already wait for one, --scale-from-zero-queue {self.options.queue}"
        return None

    def _refuse(self, why: str) -> APIError:
        retry = max(1, math.ceil(self.options.timeout / 10))
        return APIError(503, f"service unavailable: no engine is registered with the coordinator ({why}); the fleet "
                             "is scaled to zero and asked for a group: retry", code="no_engine",
                        headers={"Retry-After": str(retry)})

    async def hold(self) -> None:
        """Return at once while an engine is registered, the fleet is not RUNNING or holding is off; else wait for
        one."""
        if not self.asleep():
            return
        full = self.full()
        if full is not None:
            raise self._refuse(full)
        arrived = time.monotonic()
        deadline = arrived + self.options.timeout
        self.waiting += 1
        if self.since is None:
            self.since = arrived
        try:
            while self.asleep():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._refuse(f"none came within --scale-from-zero-timeout {self.options.timeout:g}s")
                await asyncio.sleep(min(self.monitor.interval, left))  # the monitor's next status
            if self.since is not None and self.monitor.engines:
                self._woke(time.monotonic() - self.since)
                self.since = None
        finally:
            self.waiting -= 1
            if self.waiting == 0:
                self.since = None


    def _woke(self, seconds: float) -> None:
        """The first request waiting was let through ``seconds`` after it arrived."""
        self.wake_count += 1
        self.wake_sum += seconds
        for i, bound in enumerate(WAKE_BUCKETS):
            if seconds <= bound:
                self.wake_buckets[i] += 1


class WakeCollector(Collector):
    """The gate's series, at scrape time."""

    def __init__(self, gate: WakeGate) -> None:
        self.gate = gate

    def collect(self) -> Iterable[Metric]:
        for name, value in (("requests_waiting_for_engine", self.gate.waiting),
                            ("engine_groups_wanted", 1 if self.gate.waiting else 0)):
            entry = series(name)
            yield GaugeMetricFamily(entry.base_name, entry.help, value=value)
        entry = series("wake_seconds")
        buckets = [(str(bound), float(count)) for bound, count in zip(WAKE_BUCKETS, self.gate.wake_buckets)]
        buckets.append(("+Inf", float(self.gate.wake_count)))
        yield HistogramMetricFamily(entry.base_name, entry.help, buckets=buckets, sum_value=self.gate.wake_sum)
