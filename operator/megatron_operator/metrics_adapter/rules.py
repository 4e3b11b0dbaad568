"""Which custom metric is which sum of Prometheus series from a fleet's ``/metrics``.

A rule is ``NAME=SERIES[+SERIES...]``: the metric ``NAME`` is the sum of every sample of each series (all label
sets), so per-engine-group series add up to the fleet's. A series absent from the scrape counts 0 (engine series
are absent while no engine is registered), as the Prometheus adapter's example writes with ``or 0``.
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

    def value(self, exposition: str) -> float:
        """The rule's value in one scrape (Prometheus text format)."""
        wanted = set(self.series)
        total = 0.0
        for family in text_string_to_metric_families(exposition):
            for sample in family.samples:
                if sample.name in wanted:
                    total += sample.value
        return total


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
