"""Every series ``/metrics`` exports, as data: name, type, labels, meaning, and vLLM's name for it.

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

from dataclasses import dataclass
from typing import Literal

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

SERIES: tuple[Series, ...] = (
    # ---- every engine, from its last heartbeat (vLLM's engine series, same meaning and unit)
    Series("num_requests_running", "gauge", "requests in the engine's running batch", "engine", ENGINE_LABELS,
           "vllm:num_requests_running", "requests"),
    Series("num_requests_waiting", "gauge", "requests queued inside the engine, waiting to be scheduled",
           "engine", ENGINE_LABELS, "vllm:num_requests_waiting", "requests"),
    Series("kv_cache_usage_perc", "gauge", "fraction of the engine's KV-cache blocks in use, 0 to 1", "engine",
           ENGINE_LABELS, "vllm:kv_cache_usage_perc", "fraction"),
    Series("prompt_tokens_total", "counter", "prompt tokens of the requests the engine started generating for",
           "engine", ENGINE_LABELS, "vllm:prompt_tokens_total", "tokens"),
    Series("generation_tokens_total", "counter", "tokens the engine generated", "engine", ENGINE_LABELS,
           "vllm:generation_tokens_total", "tokens"),
    Series("request_success_total", "counter", "requests the engine finished, by finish reason (stop, length, "
           "abort)", "engine", (*ENGINE_LABELS, "finished_reason"), "vllm:request_success_total", "requests"),
    Series("num_preemptions_total", "counter", "running requests the engine preempted because KV blocks ran out "
           "(each is recomputed later)", "engine", ENGINE_LABELS, "vllm:num_preemptions_total", "requests"),
    Series("prefix_cache_queries_total", "counter", "tokens the engine looked up in its prefix cache when it "
           "admitted a request", "engine", ENGINE_LABELS, "vllm:prefix_cache_queries_total", "tokens"),
    Series("prefix_cache_hits_total", "counter", "of those, tokens found in the prefix cache (not recomputed)",
           "engine", ENGINE_LABELS, "vllm:prefix_cache_hits_total", "tokens"),
    Series("external_prefix_cache_queries_total", "counter", "tokens of admitted requests not found in the "
           "engine's device prefix cache, looked up in its host tier (--kv-offloading-size)", "engine", ENGINE_LABELS,
           "vllm:external_prefix_cache_queries_total", "tokens"),
    Series("external_prefix_cache_hits_total", "counter", "of those, tokens found in the host tier and copied back "
           "to the device instead of computed", "engine", ENGINE_LABELS, "vllm:external_prefix_cache_hits_total",
           "tokens"),
    Series("kv_offload_total_bytes_total", "counter", "bytes of KV blocks copied between the device pool and the "
           "host tier, by direction (GPU_to_CPU: blocks leaving the pool; CPU_to_GPU: prefixes found on the host)",
           "engine", (*ENGINE_LABELS, "transfer_type"), "vllm:kv_offload_total_bytes_total", "bytes"),
    Series("kv_offload_total_time_total", "counter", "seconds those copies took, by direction", "engine",
           (*ENGINE_LABELS, "transfer_type"), "vllm:kv_offload_total_time_total", "seconds"),
    Series("kv_disk_usage_bytes", "gauge", "bytes of KV block files in the node's disk tier directory, every "
           "engine's (--kv-offloading-backend disk; the ledger the engines share, exact at each of its scans)",
           "engine", ENGINE_LABELS, unit="bytes"),
    Series("kv_disk_blocks", "gauge", "KV block files in that directory, every engine's", "engine", ENGINE_LABELS,
           unit="blocks"),
    Series("kv_disk_blocks_written_total", "counter", "blocks the host tier let go that the engine wrote to the disk "
           "tier", "engine", ENGINE_LABELS, unit="blocks"),
    Series("kv_disk_hits_total", "counter", "blocks the engine read back from the disk tier, sound, into its host "
           "tier", "engine", ENGINE_LABELS, unit="blocks"),
    Series("kv_disk_misses_total", "counter", "blocks the engine looked up in the disk tier and found no file of",
           "engine", ENGINE_LABELS, unit="blocks"),
    Series("kv_disk_corrupt_total", "counter", "disk tier files the engine found short, corrupt or of another key: "
           "removed, their blocks recomputed", "engine", ENGINE_LABELS, unit="blocks"),
    Series("kv_disk_evictions_total", "counter", "disk tier files the engine removed, least recently used first, to "
           "keep the directory under --kv-disk-size", "engine", ENGINE_LABELS, unit="blocks"),
    Series("kv_disk_dropped_writes_total", "counter", "blocks the host tier let go that were not written to disk "
           "because the engine's write queue was full (recomputed if asked for again)", "engine", ENGINE_LABELS,
           unit="blocks"),
    Series("kv_disk_errors_total", "counter", "disk tier file reads and writes that failed with an OS error, by "
           "operation (read, write)", "engine", (*ENGINE_LABELS, "operation"), unit="blocks"),
    Series("kv_disk_io_bytes_total", "counter", "bytes of disk tier files the engine read and wrote, by operation "
           "(read, write)", "engine", (*ENGINE_LABELS, "operation"), unit="bytes"),
    Series("kv_transfers_total", "counter", "prefill/decode disaggregation: requests whose KV blocks the engine sent "
           "on after prefill (direction sent) or continued from in decode (received)", "engine",
           (*ENGINE_LABELS, "direction"), unit="requests"),
    Series("kv_transfer_bytes_total", "counter", "bytes of those KV blocks, by direction (sent, received)", "engine",
           (*ENGINE_LABELS, "direction"), unit="bytes"),
    Series("logprob_parity_checked_total", "counter", "finished requests whose reported log probs the engine "
           "scored again as one prompt and compared bitwise (--verify-logprobs-fraction)", "engine", ENGINE_LABELS,
           unit="requests", colon_twin=True),
    Series("logprob_parity_mismatch_total", "counter", "of those, requests where some generated token's log prob "
           "differed from its score (each logged as a WARNING with the request id and first position)", "engine",
           ENGINE_LABELS, unit="requests", colon_twin=True),
    Series("spec_decode_num_drafts_total", "counter", "requests whose speculative drafts the engine verified "
           "(one per request and step with at least one draft)", "engine", ENGINE_LABELS,
           "vllm:spec_decode_num_drafts_total", "drafts", colon_twin=True),
    Series("spec_decode_num_draft_tokens_total", "counter", "speculative draft tokens the engine verified", "engine",
           ENGINE_LABELS, "vllm:spec_decode_num_draft_tokens_total", "tokens", colon_twin=True),
    Series("spec_decode_num_accepted_tokens_total", "counter", "of those, draft tokens accepted (each one the "
           "target would have produced)", "engine", ENGINE_LABELS, "vllm:spec_decode_num_accepted_tokens_total",
           "tokens", colon_twin=True),
    Series("spec_decode_num_rows_total", "counter", "decode rows that could speculate, one per request and "
           "step (drafts or not): spec_decode_num_draft_tokens_total over it is the mean K the adaptive policy "
           "chose", "engine", ENGINE_LABELS, unit="rows"),
    Series("spec_decode_num_accepted_tokens_per_pos_total", "counter", "accepted draft tokens by their position "
           "in the draft (0: the first guess)", "engine", (*ENGINE_LABELS, "position"),
           "vllm:spec_decode_num_accepted_tokens_per_pos_total", "tokens", colon_twin=True),
    Series("time_to_first_token_seconds", "histogram", "time from a request's arrival at the coordinator to "
           "its first generated token", "engine", ENGINE_LABELS, "vllm:time_to_first_token_seconds", "seconds"),
    Series("inter_token_latency_seconds", "histogram", "time between two consecutive generated tokens of a "
           "request", "engine", ENGINE_LABELS, "vllm:inter_token_latency_seconds", "seconds"),
    Series("e2e_request_latency_seconds", "histogram", "time from a request's arrival at the coordinator to "
           "its last token (completed requests)", "engine", ENGINE_LABELS, "vllm:e2e_request_latency_seconds",
           "seconds"),
    Series("request_queue_time_seconds", "histogram", "time from a request's arrival at the coordinator until "
           "an engine first scheduled it (coordinator queue plus engine queue)", "engine", ENGINE_LABELS,
           "vllm:request_queue_time_seconds", "seconds"),
    Series("lora_adapter_load_seconds", "histogram", "time an engine took to read, check and register a LoRA "
           "adapter it was told to serve while running (LOAD_LORA, /v1/load_lora_adapter, add_lora)", "engine",
           ENGINE_LABELS, unit="seconds"),
    # ---- EPLB (--enable-eplb), every engine of an expert-parallel group that balances its experts
    Series("eplb_balancedness", "gauge", "EPLB: each MoE layer's balancedness, the mean over the max of the tokens "
           "per expert-parallel rank (1: even), measured over the window the last rearrangement was planned from",
           "engine", (*ENGINE_LABELS, "layer"), unit="fraction"),
    Series("eplb_planned_balancedness", "gauge", "EPLB: the balancedness each MoE layer's placement gives that "
           "window's load (what the layer's rearrangement planned for, or its placement as it stays)", "engine",
           (*ENGINE_LABELS, "layer"), unit="fraction"),
    Series("eplb_rearrangements_total", "counter", "EPLB: plans that moved the experts of at least one MoE layer",
           "engine", ENGINE_LABELS, unit="rearrangements"),
    Series("eplb_layers_moved_total", "counter", "EPLB: MoE layers whose experts moved and were swapped in",
           "engine", ENGINE_LABELS, unit="layers"),
    Series("eplb_rearrangement_seconds_total", "counter", "EPLB: seconds the steps waited for the balancer between "
           "two steps (planning, the end of a move's transfer, the swap; the transfers themselves run beside the "
           "steps)", "engine", ENGINE_LABELS, unit="seconds"),
    # ---- the fleet, from the coordinator's STATUS (no vLLM twin)
    Series("coordinator_reachable", "gauge", "1 while the coordinator answers STATUS", "fleet"),
    Series("lifecycle_state", "gauge", "1 for the fleet's current lifecycle state (RUNNING, PAUSED, "
           "SUSPENDED, STOPPED), 0 for the others", "fleet", ("state",)),
    Series("engines", "gauge", "engine groups registered with the coordinator", "fleet"),
    Series("queue_depth", "gauge", "requests queued at the coordinator, not yet sent to an engine", "fleet",
           unit="requests"),
    Series("requests_in_flight", "gauge", "requests the coordinator has sent to engines", "fleet", unit="requests"),
    Series("kv_blocks_used", "gauge", "KV cache blocks in use, all engines", "fleet", unit="blocks"),
    Series("kv_blocks_total", "gauge", "KV cache blocks, all engines", "fleet", unit="blocks"),
    Series("engine_computed_tokens", "gauge", "tokens the engines ran through the model, prefill and decode "
           "(sum of the engines' counters since they started)", "fleet", unit="tokens"),
    Series("weights_epoch", "gauge", "generation (REFIT epoch) of the weights the fleet serves", "fleet"),
    Series("refits_total", "counter", "REFITs the coordinator completed since it started", "fleet"),
    Series("engine_weights_epoch", "gauge", "generation of the weights each engine serves", "fleet",
           ("engine", "group")),
    Series("engine_refit_seconds", "gauge", "duration of each engine's last refit, by phase (verify: shape "
           "check; load: copying weights in place; total)", "fleet", ("engine", "group", "phase"), None, "seconds"),
    # ---- this server's own requests
    Series("http_requests_total", "counter", "HTTP requests answered, by route template and status code",
           "server", ("route", "code")),
    Series("requests_total", "counter", "generation requests this server finished, by outcome: "
           "completed, failed, aborted", "server", ("status",)),
    Series("finish_reasons_total", "counter", "completed choices this server returned, by finish reason (stop, "
           "length)", "server", ("reason",)),
    Series("cached_prompt_tokens_total", "counter", "prompt tokens of the requests this server finished that "
           "were served from the prefix cache", "server", unit="tokens"),
    Series("finished_prompt_tokens_total", "counter", "prompt tokens of the requests this server finished (the "
           "hit rate's denominator)", "server", unit="tokens"),
    Series("prefix_cache_hit_rate", "gauge", "cached prompt tokens / prompt tokens of the requests this "
           "server finished (0 before any)", "server", unit="fraction"),
    Series("time_per_output_token_seconds", "histogram", "mean time between a request's generated tokens "
           "after the first, one observation per request", "server", (),
           "vllm:request_time_per_output_token_seconds", "seconds"),
    Series("server_pending_requests", "gauge", "engine requests this server is waiting on", "server",
           unit="requests"),
    # ---- scale from zero (server/wake.py): requests held while no engine is registered
    Series("requests_waiting_for_engine", "gauge", "requests this server holds because no engine is registered "
           "(a fleet scaled to zero)", "server", unit="requests"),
    Series("engine_groups_wanted", "gauge", "1 while requests wait for a first engine group: the desired-replicas "
           "hint of an autoscaler that scales the fleet from zero", "server", unit="groups"),
    Series("wake_seconds", "histogram", "how long the first request held by a fleet with no engine waited until "
           "one registered", "server", unit="seconds"),
    # ---- this server's requests by tenant and class (docs/tenants.md; only with tenants configured)
    Series("tenant_requests_total", "counter", "engine requests of each tenant this server finished", "server",
           TENANT_LABELS, unit="requests"),
    Series("tenant_prompt_tokens_total", "counter", "prompt tokens of those requests (vllm:prompt_tokens_total by "
           "tenant)", "server", TENANT_LABELS, unit="tokens"),
    Series("tenant_generation_tokens_total", "counter", "tokens generated for those requests "
           "(vllm:generation_tokens_total by tenant)", "server", TENANT_LABELS, unit="tokens"),
    Series("tenant_request_queue_time_seconds", "histogram", "time from a request's arrival at the coordinator "
           "until an engine first scheduled it (vllm:request_queue_time_seconds by tenant)", "server", TENANT_LABELS,
           unit="seconds"),
    Series("tenant_num_preemptions_total", "counter", "times those requests were preempted, by a request of a "
           "better class or because KV blocks ran out (vllm:num_preemptions_total by tenant)", "server",
           TENANT_LABELS, unit="requests"),
    Series("tenant_requests_refused_total", "counter", "requests refused before they started, by reason: over the "
           "tenant's requests_per_minute, tokens_per_minute or max_concurrent (429), or sheddable while the fleet "
           "is saturated (503)", "server", (*TENANT_LABELS, "reason"), unit="requests"),
)

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
