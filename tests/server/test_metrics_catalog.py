"""``/metrics`` exports exactly the catalogued series, and engine reports are read defensively."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from prometheus_client.parser import text_string_to_metric_families

from megatron_serve.wire.engine_stats import EPLB, KV_DISK, KV_OFFLOAD, KV_TRANSFER, EngineStats
from megatron_serve.server import metric_catalog
from megatron_serve.server.metric_catalog import SERIES
from megatron_serve.http_options import WakeOptions
from megatron_serve.server.wake import WakeCollector, WakeGate
from megatron_serve.server.metrics import ServerMetrics
from megatron_serve.wire.request import DynamicInferenceRequest, EventType, RequestEvent


class Monitor:
    """The FleetMonitor views ServerMetrics reads, over a fixed STATUS_REPLY."""

    def __init__(self, engines: list[dict[str, Any]]) -> None:
        self.reachable = True
        self.state = "RUNNING"
        self.status = {"state": "RUNNING", "queued": 3, "in_flight": 2, "epoch": 1, "refits": 1, "engines": engines}
        self.engines = engines

    def totals(self) -> dict[str, int]:
        return {"engines": len(self.engines), "queued": 3, "in_flight": 2, "kv_blocks_used": 4, "kv_blocks_total": 16,
                "computed_tokens": 7}


def engine(group: int, report: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"e{group}", "group": group, "running": 2, "waiting": 1, "kv_blocks_free": 6, "kv_blocks_total": 8,
            "epoch": 1, "last_refit": {"verify_s": 0.1, "load_s": 0.2, "total_s": 0.3}, "metrics": report}


def scrape(engines: list[dict[str, Any]]) -> dict[str, Any]:
    metrics = ServerMetrics(Monitor(engines), lambda: 0, "llama")  # type: ignore[arg-type]
    metrics.add_collector(WakeCollector(WakeGate(Monitor(engines), WakeOptions())))  # type: ignore[arg-type] - as app
    metrics.http_requests.labels("/v1/completions", "200").inc()
    metrics.tpot.observe(0.01)
    metrics.enable_tenants()  # a server with tenants (docs/tenants.md): its per-tenant series
    request = DynamicInferenceRequest("r", None, [1, 2], generated_tokens=[3], arrival_time=10.0,
                                      events=[RequestEvent(EventType.PREFILL, 10.5), RequestEvent(EventType.PREEMPT, 11)])
    metrics.observe_tenant_request(("team-a", "critical"), request)
    metrics.count_tenant_refusal(("team-a", "critical"), "requests_per_minute")
    text = metrics.render()[0].decode()
    # prometheus-client adds a <name>_created gauge (creation time) to its own counters and histograms
    return {family.name: family for family in text_string_to_metric_families(text)
            if not family.name.endswith("_created")}


def a_report() -> dict[str, Any]:
    stats = EngineStats()
    stats.counters["generation_tokens"] = 12
    stats.histograms["time_to_first_token_seconds"].observe(0.3)
    stats.finished["stop"] = 2
    stats.speculated(3, 2)  # speculative decoding: 2 of 3 guesses accepted (positions 0 and 1)
    stats.counters["spec_decode_num_rows"] = 6  # of 6 decode rows that could speculate (mean K 0.5)
    report = stats.to_wire(prefix_cache_queries=40, prefix_cache_hits=16)
    report[KV_OFFLOAD] = {"GPU_to_CPU": {"bytes": 8192, "seconds": 0.25}, "CPU_to_GPU": {"bytes": 4096, "seconds": 0.5}}
    report[KV_TRANSFER] = {"sent": {"transfers": 3, "bytes": 3072}, "received": {"transfers": 0, "bytes": 0}}
    report[KV_DISK] = {"written": 5, "hits": 2, "misses": 3, "corrupt": 1, "evicted": 4, "dropped": 6,
                       "read_errors": 0, "write_errors": 7, "read_bytes": 2048, "write_bytes": 5120,
                       "usage_bytes": 4096, "files": 4}
    report[EPLB] = {"layers": [1, 3], "measured": [0.5, 0.625], "planned": [1.0, 0.875], "rearrangements": 2,
                    "layers_moved": 3, "seconds": 0.25}
    return report


def test_eplb_balancedness_is_per_layer_and_its_counts_per_engine():
    before_any_plan = copy.deepcopy(a_report())
    for key in ("measured", "planned"):
        del before_any_plan[EPLB][key]
    broken = copy.deepcopy(a_report())
    broken[EPLB].update(measured=[0.5], planned=["x", 0.5], seconds=-1)
    families = scrape([engine(0, a_report()), engine(1, before_any_plan), engine(2, broken)])
    measured = {(s.labels["engine_group"], s.labels["layer"]): s.value
                for s in families["megatron_serve_eplb_balancedness"].samples}
    planned = {(s.labels["engine_group"], s.labels["layer"]): s.value
               for s in families["megatron_serve_eplb_planned_balancedness"].samples}
    assert measured == {("0", "1"): 0.5, ("0", "3"): 0.625}  # none before a plan; one of two values is no map
    assert planned == {("0", "1"): 1.0, ("0", "3"): 0.875, ("2", "3"): 0.5}
    counts = {name: {s.labels["engine_group"]: s.value for s in families[f"megatron_serve_eplb_{name}"].samples}
              for name in ("rearrangements", "layers_moved", "rearrangement_seconds")}
    assert counts == {"rearrangements": {"0": 2, "1": 2, "2": 2}, "layers_moved": {"0": 3, "1": 3, "2": 3},
                      "rearrangement_seconds": {"0": 0.25, "1": 0.25}}


def test_prefill_decode_transfers_are_counted_by_direction():
    families = scrape([engine(0, a_report())])
    transfers = {s.labels["direction"]: s.value for s in families["megatron_serve_kv_transfers"].samples}
    moved = {s.labels["direction"]: s.value for s in families["megatron_serve_kv_transfer_bytes"].samples}
    assert transfers == {"sent": 3, "received": 0} and moved == {"sent": 3072, "received": 0}


def test_the_disk_tier_s_counts_are_series_of_their_own_and_its_io_by_operation():
    families = scrape([engine(0, a_report())])
    plain = {name: families[f"megatron_serve_kv_disk_{name}"].samples[0].value
             for name in ("usage_bytes", "blocks", "blocks_written", "hits", "misses", "corrupt", "evictions",
                          "dropped_writes")}
    assert plain == {"usage_bytes": 4096, "blocks": 4, "blocks_written": 5, "hits": 2, "misses": 3, "corrupt": 1,
                     "evictions": 4, "dropped_writes": 6}
    by_operation = {(name, s.labels["operation"]): s.value for name in ("errors", "io_bytes")
                    for s in families[f"megatron_serve_kv_disk_{name}"].samples}
    assert by_operation == {("errors", "read"): 0, ("errors", "write"): 7, ("io_bytes", "read"): 2048,
                            ("io_bytes", "write"): 5120}
    assert not scrape([engine(0, {**a_report(), KV_DISK: None})])["megatron_serve_kv_disk_hits"].samples


def test_the_host_tier_s_copies_are_vllm_s_series_by_transfer_type():
    families = scrape([engine(0, a_report())])
    bytes_by_type = {sample.labels["transfer_type"]: sample.value
                     for sample in families["megatron_serve_kv_offload_total_bytes"].samples}
    seconds_by_type = {sample.labels["transfer_type"]: sample.value
                       for sample in families["megatron_serve_kv_offload_total_time"].samples}
    assert bytes_by_type == {"GPU_to_CPU": 8192, "CPU_to_GPU": 4096}
    assert seconds_by_type == {"GPU_to_CPU": 0.25, "CPU_to_GPU": 0.5}
    assert {sample.value for sample in families["megatron_serve_external_prefix_cache_hits"].samples} == {0}


def test_exported_families_are_the_catalogue():
    families = scrape([engine(0, a_report())])
    # the parser names counters without _total
    catalogued = {s.full_name[: -len("_total")] if s.kind == "counter" else s.full_name for s in SERIES}
    twins = {s.colon_name.removesuffix("_total") for s in SERIES if s.colon_name}
    assert twins == {"megatron:logprob_parity_checked", "megatron:logprob_parity_mismatch",
                     "megatron:spec_decode_num_drafts", "megatron:spec_decode_num_draft_tokens",
                     "megatron:spec_decode_num_accepted_tokens", "megatron:spec_decode_num_accepted_tokens_per_pos"}
    assert set(families) == catalogued | twins
    for entry in SERIES:
        family = families[entry.base_name]
        assert family.type == entry.kind, entry.name
        sample_labels = {k for sample in family.samples for k in sample.labels if k not in ("le",)}
        assert sample_labels == set(entry.labels), entry.name


def test_speculative_counters_reach_the_megatron_series_per_position():
    families = scrape([engine(0, a_report())])
    values = {(s.name, s.labels.get("position")): s.value for name, family in families.items()
              if name.startswith("megatron_serve_spec_decode") for s in family.samples if not s.name.endswith("_created")}
    prefix = "megatron_serve_spec_decode_num_"
    assert values == {(prefix + "drafts_total", None): 1.0, (prefix + "draft_tokens_total", None): 3.0,
                      (prefix + "accepted_tokens_total", None): 2.0, (prefix + "rows_total", None): 6.0,
                      (prefix + "accepted_tokens_per_pos_total", "0"): 1.0,
                      (prefix + "accepted_tokens_per_pos_total", "1"): 1.0,
                      (prefix + "accepted_tokens_per_pos_total", "2"): 0.0}


def test_colon_twins_carry_the_same_samples_as_their_series():
    stats = EngineStats()
    stats.counters.update(logprob_parity_checked=5, logprob_parity_mismatch=1)
    stats.speculated(2, 1)
    report = stats.to_wire(prefix_cache_queries=0, prefix_cache_hits=0)
    families = scrape([engine(0, report), engine(2, report)])

    def samples(name: str) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
        return {(s.name.split("_", 2)[-1] if s.name.startswith("megatron_serve_") else s.name.split(":", 1)[1],
                 tuple(sorted(s.labels.items())), s.value) for s in families[name].samples}

    for entry in (s for s in SERIES if s.colon_name):
        base, twin = entry.base_name, entry.colon_name.removesuffix("_total")
        assert samples(twin) == samples(base) and samples(base), entry.name
    checked = {s.labels["engine_group"]: s.value for s in families["megatron:logprob_parity_checked"].samples}
    assert checked == {"0": 5.0, "2": 5.0}


def test_engine_series_are_labelled_by_group_and_model():
    families = scrape([engine(0, a_report()), engine(3, a_report())])
    usage = {s.labels["engine_group"]: s.value for s in families["megatron_serve_kv_cache_usage_perc"].samples}
    assert usage == {"0": 0.25, "3": 0.25}
    tokens = [s for s in families["megatron_serve_generation_tokens"].samples if s.name.endswith("_total")]
    assert {(s.labels["engine_group"], s.labels["model_name"], s.value) for s in tokens} == {("0", "llama", 12.0),
                                                                                            ("3", "llama", 12.0)}
    ttft = {s.labels.get("le"): s.value for s in families["megatron_serve_time_to_first_token_seconds"].samples
            if s.name.endswith("_bucket") and s.labels["engine_group"] == "0"}
    assert ttft["0.25"] == 0 and ttft["0.5"] == 1 and ttft["+Inf"] == 1  # cumulative buckets
    hits = {s.labels["engine_group"]: s.value for s in families["megatron_serve_prefix_cache_hits"].samples
            if s.name.endswith("_total")}
    assert hits == {"0": 16.0, "3": 16.0}


def test_malformed_engine_reports_are_left_out_and_never_break_the_scrape():
    good = a_report()
    bad_bounds = copy.deepcopy(good)
    bad_bounds["histograms"]["time_to_first_token_seconds"]["le"] = [1.0]
    negative = copy.deepcopy(good)
    negative["counters"]["generation_tokens"] = -5
    strings = copy.deepcopy(good)
    strings["histograms"]["e2e_request_latency_seconds"]["counts"] = ["x"] * 25
    families = scrape([engine(0, bad_bounds), engine(1, negative), engine(2, strings), engine(3, "garbage"),
                       engine(4, None)])  # type: ignore[arg-type]
    ttft_groups = {s.labels["engine_group"] for s in families["megatron_serve_time_to_first_token_seconds"].samples}
    assert ttft_groups == {"1", "2"}  # engine 0's histogram has other bounds
    tokens = {s.labels["engine_group"] for s in families["megatron_serve_generation_tokens"].samples}
    assert tokens == {"0", "2"}  # engine 1 reported a negative counter
    e2e = {s.labels["engine_group"] for s in families["megatron_serve_e2e_request_latency_seconds"].samples}
    assert e2e == {"0", "1"}
    running = {s.labels["engine_group"] for s in families["megatron_serve_num_requests_running"].samples}
    assert running == {"0", "1", "2", "3", "4"}  # the heartbeat's plain fields still count


def test_the_stats_line_reports_the_mean_acceptance_length_only_when_drafts_were_verified():
    from megatron_serve.server.stats_log import FleetCounters, stats_line  # noqa: PLC0415

    monitor = Monitor([engine(0, a_report())])
    before = FleetCounters(0.0, 0.0, 0.0, 0.0, 0.0, drafts=10.0, accepted=5.0)
    now = FleetCounters(10.0, 0.0, 100.0, 0.0, 0.0, drafts=30.0, accepted=45.0)  # 40 accepted over 20 verified rows
    line, busy = stats_line(before, now, monitor)  # type: ignore[arg-type]
    assert busy and line.endswith(", speculative mean acceptance length 3.00")
    line, _ = stats_line(before, FleetCounters(10.0, 0.0, 100.0, 0.0, 0.0, drafts=10.0, accepted=5.0), monitor)  # type: ignore[arg-type]
    assert "speculative" not in line  # no drafts in the interval: no figure
    assert FleetCounters.read(monitor, 1.0).drafts == 1.0  # type: ignore[arg-type] - from the engines' counters


def test_the_stats_line_reports_the_mean_k_over_the_rows_that_could_speculate():
    from megatron_serve.server.stats_log import FleetCounters, stats_line  # noqa: PLC0415

    monitor = Monitor([engine(0, a_report())])
    before = FleetCounters(0.0, 0.0, 0.0, 0.0, 0.0, draft_tokens=10.0, rows=20.0)
    now = FleetCounters(10.0, 0.0, 100.0, 0.0, 0.0, draft_tokens=70.0, rows=60.0)  # 60 drafts over 40 rows
    assert stats_line(before, now, monitor)[0].endswith(", speculative mean K 1.50")  # type: ignore[arg-type]
    idle = FleetCounters(10.0, 0.0, 100.0, 0.0, 0.0, draft_tokens=10.0, rows=60.0)  # K = 0: rows, no drafts
    assert stats_line(before, idle, monitor)[0].endswith(", speculative mean K 0.00")  # type: ignore[arg-type]
    counters = FleetCounters.read(monitor, 1.0)  # type: ignore[arg-type] - from the engines' counters
    assert (counters.draft_tokens, counters.rows) == (3.0, 6.0)


def test_the_data_parallel_ranks_of_one_group_are_series_of_their_own():
    """The attention ranks of a data-parallel group are engines sharing its group: one series each (``0-dp1``), not
    two samples under one label set, which a Prometheus scrape rejects."""
    ranks = [{**engine(0, a_report()), "id": f"e{d}-g0-dp{d}", "info": {"data_parallel_rank": d,
                                                                      "data_parallel_size": 2}} for d in (0, 1)]
    families = scrape([*ranks, engine(1, a_report())])
    usage = {s.labels["engine_group"]: s.value for s in families["megatron_serve_kv_cache_usage_perc"].samples}
    assert usage == {"0-dp0": 0.25, "0-dp1": 0.25, "1": 0.25}


def test_catalogue_rows_are_checked_at_load(tmp_path: Path) -> None:
    """``metric_catalog.yaml``'s rows become the catalogue; a key it does not know, or an engine series not labelled
    by engine first (what the per-engine collector fills in), is refused naming the row."""
    table = tmp_path / "metric_catalog.yaml"
    table.write_text("- {name: x_total, kind: counter, source: engine, labels: [engine_group, model_name, reason], "
                     "help: h}\n- {name: y, kind: gauge, source: fleet, help: h}\n")
    assert [(s.name, s.labels) for s in metric_catalog._load(table)] == [
        ("x_total", ("engine_group", "model_name", "reason")), ("y", ())]
    table.write_text("- {name: x_total, kind: counter, source: engine, labels: [reason], help: h}\n")
    with pytest.raises(ValueError, match="x_total: an engine series is labelled engine_group, model_name first"):
        metric_catalog._load(table)
    table.write_text("- {name: y, kind: gauge, source: fleet, help: h, units: s}\n")
    with pytest.raises(ValueError, match=r"metric_catalog.yaml y: unknown key\(s\) units"):
        metric_catalog._load(table)
