"""Which custom metric is which sum of Prometheus series from a fleet's ``/metrics``.

A rule is ``NAME=SERIES[+SERIES...]``: the metric ``NAME`` is the sum of every sample of each series (all label
sets), so per-engine-group series add up to the fleet's. A series absent from the scrape counts 0 (engine series
are absent while no engine is registered), as the Prometheus adapter's example writes with ``or 0``. A scrape whose
server does not reach its coordinator (``megatron_serve_coordinator_reachable`` 0) has no fleet figures to sum: its
zeros would read as an idle fleet and scale it down, so it answers nothing (:func:`fleet_unknown`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


@dataclass(frozen=True)
class MetricRule:
    """One custom metric: its name and the series it sums."""

    name: str
    series: tuple[str, ...]

    def value(self, sums: dict[str, float]) -> float:
        """The rule's value in one scrape (:func:`sample_sums`)."""
        return sum(sums.get(series, 0.0) for series in self.series)


REACHABLE = "megatron_serve_coordinator_reachable"


def sample_sums(exposition: str) -> dict[str, float]:
    """One scrape (Prometheus text format): each series' samples summed over their label sets."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def fleet_unknown(sums: dict[str, float]) -> bool:
    """Whether the scraped server said it does not reach its coordinator (its fleet series are not the fleet's)."""
    return sums.get(REACHABLE, 1.0) == 0.0


def parse_rule(text: str) -> MetricRule:
    """``NAME=SERIES[+SERIES...]`` -> a rule; a malformed one raises ``ValueError`` naming it."""
    name, sep, expression = text.partition("=")
    series = tuple(s.strip() for s in expression.split("+"))
    bad = [s for s in (name.strip(), *series) if not _NAME.match(s)]
    if not sep or bad:
        raise ValueError(f"metric rule {text!r}: expected NAME=SERIES[+SERIES...] with Prometheus names"
                         + (f" ({', '.join(repr(b) for b in bad)} is not one)" if sep and bad else ""))
    return MetricRule(name.strip(), series)


#: The metrics served without ``--metric``: the queue that hpa-queue-depth.yaml and the Prometheus adapter's
#: example scale on, every request the fleet holds (queued or at an engine: what a concurrency target per engine
#: group divides, the same whatever the number of groups), and the scale-from-zero hint.
DEFAULT_RULES = (
    MetricRule("megatron_serve_queue", ("megatron_serve_queue_depth", "megatron_serve_num_requests_waiting")),
    MetricRule("megatron_serve_requests", ("megatron_serve_queue_depth", "megatron_serve_requests_in_flight")),
    MetricRule("megatron_serve_engine_groups_wanted", ("megatron_serve_engine_groups_wanted",)),
)


def rules_by_name(rules: tuple[MetricRule, ...]) -> dict[str, MetricRule]:
    """The rules keyed by name; a later rule of the same name replaces an earlier one (``--metric`` over a
    default)."""
    return {rule.name: rule for rule in rules}
