"""Every series ``/metrics`` exports, as data (``metric_catalog.yaml`` beside this module, read once at import):
name, type, labels, meaning, and vLLM's name for it.

One table feeds three things: :mod:`.metrics` builds its counters, histograms and collected
families from it (so a series cannot be exported without an entry), the generated metrics
reference page lists it (``make docs``), and the Grafana dashboard and autoscaling examples are
checked against it. Names are given as Prometheus exposes them (counters end in ``_total``).

``source`` says where the numbers come from:

* ``engine``: each engine's cumulative counters and histograms (:mod:`megatron_serve.wire.engine_stats`),
  shipped in its heartbeat, kept by the coordinator and read from ``STATUS_REPLY`` at scrape time,
  one series per engine group (labels ``engine_group`` and ``model_name``);
* ``fleet``: the coordinator's own facts from the same ``STATUS_REPLY``;
* ``server``: observed by this server (its own HTTP requests and results; with ``--api-server-count``
  N > 1, summed over its N processes at every scrape).

Engine and fleet series are the same on every server replica in front of one fleet: aggregate them
with ``max``/``avg`` over replicas (or scrape one), never ``sum``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import yaml

PREFIX = "megatron_serve"

Kind = Literal["counter", "gauge", "histogram"]
Source = Literal["engine", "fleet", "server"]


@dataclass(frozen=True)
class Series:
    """One exported metric family."""

    name: str  # without the prefix; counters include their ``_total`` suffix
    kind: Kind
    help: str
    source: Source
    labels: tuple[str, ...] = ()
    vllm: str | None = None  # vLLM's series with the same meaning and unit, if it has one
    unit: str = ""
    colon_twin: bool = False  # also exported as ``megatron:<name>``, the spelling RL dashboards copy from vLLM's

    @property
    def colon_name(self) -> str | None:
        """``megatron:<name>`` where the series has that twin: the name RL users look for beside ``vllm:...``."""
        return f"megatron:{self.name}" if self.colon_twin else None

    @property
    def full_name(self) -> str:
        return f"{PREFIX}_{self.name}"

    @property
    def base_name(self) -> str:
        """The name prometheus-client is given (it appends ``_total`` to counters itself)."""
        return self.full_name[: -len("_total")] if self.kind == "counter" else self.full_name


ENGINE_LABELS = ("engine_group", "model_name")
#: Labels of the per-tenant series: the tenant's name and its class (critical, standard, sheddable).
TENANT_LABELS = ("tenant", "priority_class")

_FIELDS = frozenset(field.name for field in fields(Series))


def _load(path: Path) -> tuple[Series, ...]:
    """The rows of ``metric_catalog.yaml``; a key the table does not know, or an engine series without the engine
    labels first, is an error naming the row."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where PyYAML has it
    with open(path, encoding="utf-8") as file:
        rows = yaml.load(file, Loader=loader)
    series = []
    for row in rows:
        unknown = sorted(set(row) - _FIELDS)
        if unknown:
            raise ValueError(f"metric_catalog.yaml {row.get('name')}: unknown key(s) {', '.join(unknown)}")
        entry = Series(**{**row, "labels": tuple(row.get("labels", ()))})
        if entry.source == "engine" and entry.labels[:len(ENGINE_LABELS)] != ENGINE_LABELS:
            raise ValueError(f"metric_catalog.yaml {entry.name}: an engine series is labelled "
                             f"{', '.join(ENGINE_LABELS)} first, got {entry.labels}")
        series.append(entry)
    return tuple(series)


#: Every row, read once from ``metric_catalog.yaml`` beside this module.
SERIES: tuple[Series, ...] = _load(Path(__file__).with_name("metric_catalog.yaml"))

BY_NAME: dict[str, Series] = {s.name: s for s in SERIES}

#: Labels of every ``vllm:`` series (vLLM's own: the served model, and the engine index).
VLLM_LABELS = ("model_name", "engine")


@dataclass(frozen=True)
class VllmSeries:
    """A series ``--metrics-compat vllm`` exports under vLLM's name, labels and unit.

    The fleet behind one server is one vLLM engine (``engine="0"``) to a router: gauges and
    counters are summed over the engine groups, histograms bucket by bucket, and the queue counts
    the coordinator's too. ``twin``: the catalogue series it is made from (None: made here).
    """

    name: str  # as exposed (counters end in ``_total``)
    kind: Kind
    help: str
    twin: str | None
    labels: tuple[str, ...] = VLLM_LABELS


VLLM_SERIES: tuple[VllmSeries, ...] = (
    VllmSeries("vllm:num_requests_waiting", "gauge", "requests waiting to be scheduled: queued at the coordinator "
               "plus waiting inside the engines", "num_requests_waiting"),
    *(VllmSeries(s.vllm, s.kind, s.help + (" (all engine groups together)" if s.source == "engine" else ""), s.name,
                 (*VLLM_LABELS, *(label for label in s.labels if label not in ENGINE_LABELS)))
      for s in SERIES if s.vllm is not None and s.name != "num_requests_waiting"),
    VllmSeries("vllm:gpu_cache_usage_perc", "gauge", "the same as vllm:kv_cache_usage_perc, under the name older "
               "routers read (vLLM before 0.10)", "kv_cache_usage_perc"),
    VllmSeries("vllm:cache_config_info", "gauge", "1, labelled with the KV cache's configuration: block_size "
               "(tokens per block) and num_gpu_blocks (blocks, all engine groups), as the Gateway API Inference "
               "Extension's prefix-cache scorer reads them", None,
               (*VLLM_LABELS, "block_size", "num_gpu_blocks")),
    VllmSeries("vllm:lora_requests_info", "gauge", "the wall-clock time (seconds since the epoch) of the engines' "
               "latest report, labelled with max_lora (adapter slots, all engine groups), and the LoRA adapters "
               "of the running and of the waiting requests (comma-separated names), as vLLM exports it and the "
               "Gateway API Inference Extension's LoRA affinity reads it; only with engines started with "
               "--enable-lora", None, ("max_lora", "waiting_lora_adapters", "running_lora_adapters")),
)


def series(name: str) -> Series:
    """The catalogue entry called ``name`` (without the prefix); ``KeyError`` names what is missing."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no series {name!r} in the metric catalogue") from None
