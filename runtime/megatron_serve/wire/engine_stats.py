"""Engine-level counters and histograms, kept as plain integers and shipped whole in each heartbeat.

An engine process serves no HTTP: the server's ``/metrics`` sees the fleet through the
coordinator's ``STATUS_REPLY``, which carries each engine's last heartbeat. So an engine keeps
*cumulative* counters and histogram bucket counts (never deltas: a lost or duplicated heartbeat
then changes nothing) and :meth:`EngineStats.to_wire` copies them into the heartbeat's optional
``metrics`` field once per publication (at most every 0.2 s), not once per token.

The meanings and units are vLLM's (``vllm:time_to_first_token_seconds`` and so on), so dashboards
and alerts written for vLLM read these series unchanged; the bucket bounds are a superset of
vLLM's, so its ``le`` thresholds exist here too. Cost on the step loop: one pass per step over the
requests that sampled (a few attribute reads and integer additions each; histograms are observed
once per distinct value, e.g. one inter-token gap for a whole decode batch), next to the
detokenizer and sampler work the same requests already cost (``benchmarks/engine_metrics.py``
measures it; the figures: docs/design-measurements.md).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, Protocol

from .request import EventType, FinalRecord, FinishReason

# vLLM's bounds, plus finer ones below its smallest where a GPU engine commonly lands.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                       0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# A LoRA adapter's read and check: a few ms for a small rank, seconds for a large one on a network volume.
LORA_LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: histogram name (as exported, without the prefix) -> bucket bounds
HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "time_to_first_token_seconds": TTFT_BUCKETS,
    "inter_token_latency_seconds": INTER_TOKEN_BUCKETS,
    "e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
    "request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "lora_adapter_load_seconds": LORA_LOAD_BUCKETS,
}
#: counter names on the wire (the exported name adds ``_total``)
COUNTERS = ("prompt_tokens", "generation_tokens", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
            "logprob_parity_checked", "logprob_parity_mismatch", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens", "spec_decode_num_rows", "external_prefix_cache_queries",
            "external_prefix_cache_hits")
#: the per-position acceptance counter on the wire: {"0": accepted at draft position 0, ...}
ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
#: the host KV tier's copies on the wire: {"GPU_to_CPU": {"bytes": n, "seconds": s}, "CPU_to_GPU": {...}}
KV_OFFLOAD = "kv_offload"
KV_OFFLOAD_DIRECTIONS = ("GPU_to_CPU", "CPU_to_GPU")
#: the disk KV tier on the wire (engine.kv.disk_io.DiskIO.to_wire): this engine's blocks "written", "hits", "misses",
#: "corrupt", "evicted", "dropped" (write queue full), "<operation>_errors" and "<operation>_bytes" per operation,
#: and the node directory's "usage_bytes" and "files"
KV_DISK = "kv_disk"
KV_DISK_OPERATIONS = ("read", "write")
#: prefill/decode disaggregation's blocks on the wire: {"sent": {"transfers": n, "bytes": b}, "received": {...}}
KV_TRANSFER = "kv_transfer"
KV_TRANSFER_DIRECTIONS = ("sent", "received")
#: EPLB's balancing on the wire (``--enable-eplb``; engine.experts.balancer.BalancerStats.to_wire): {"layers": [decoder
#: layer of each MoE layer], "measured": [balancedness per layer, over the last window planned from; absent before
#: the first plan], "planned": [...], "rearrangements": n, "layers_moved": n, "seconds": s}
EPLB = "eplb"
#: finish reasons counted by ``request_success``
FINISH_REASONS = (FinishReason.STOP.value, FinishReason.LENGTH.value, FinishReason.ABORT.value)


class Histogram:
    """Fixed bounds, one count per bucket plus the overflow bucket (``le="+Inf"``), and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times  # le is inclusive: value == bound fits
        self.sum += value * times

    def to_wire(self) -> dict[str, Any]:
        return {"le": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class SampledSequence(Protocol):
    """What :meth:`EngineStats.observe_step` reads and writes of a scheduler ``Sequence``."""

    last_token_at: float | None
    num_output: int  # tokens generated, this step's included
    num_prompt: int
    arrival_time: float
    first_token_time: float | None


class SampledOutput(Protocol):
    """What it reads of an engine ``StepOutput``."""

    new_tokens: list[int]
    finished: bool
    final: FinalRecord | None  # once finished


class EngineStats:
    """The counters and histograms of one engine since it started (see the module docstring)."""

    def __init__(self) -> None:
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.histograms = {name: Histogram(bounds) for name, bounds in HISTOGRAMS.items()}
        self.accepted_per_pos: list[int] = []  # speculative drafts accepted, by position in the draft

    def speculated(self, drafts: int, accepted: int) -> None:
        """One request's drafts were verified (speculative decoding): ``accepted`` of ``drafts`` kept (0 when the
        verification is launched and read later: :meth:`accepted_drafts` counts them then)."""
        if not drafts:
            return
        counters = self.counters
        counters["spec_decode_num_drafts"] += 1
        counters["spec_decode_num_draft_tokens"] += drafts
        if len(self.accepted_per_pos) < drafts:
            self.accepted_per_pos.extend([0] * (drafts - len(self.accepted_per_pos)))
        self.accepted_drafts(accepted)

    def accepted_drafts(self, accepted: int) -> None:
        """The first ``accepted`` drafts of a request, counted by :meth:`speculated` already, were kept."""
        self.counters["spec_decode_num_accepted_tokens"] += accepted
        for position in range(accepted):
            self.accepted_per_pos[position] += 1

    def observe_step(self, sequences: Sequence[SampledSequence], outputs: Sequence[SampledOutput], now: float) -> None:
        """The requests that sampled in a step that ended at ``now`` (monotonic), and what each added.

        Inter-token gaps are grouped by the time of the previous token (the requests that also
        sampled in the previous step share it), so the histogram sees one observation per distinct
        gap, not one per token.
        """
        gaps: dict[float, int] = {}
        generated = 0
        for sequence, out in zip(sequences, outputs):
            count = len(out.new_tokens)
            generated += count
            last = sequence.last_token_at
            if sequence.num_output == count:  # nothing generated before: its first sampled token
                self._first_token(sequence)
            elif last is not None:  # None: it came from another engine mid-generation
                gaps[last] = gaps.get(last, 0) + 1
            sequence.last_token_at = now
            if out.final is not None:
                self.finish(out.final)
        self.counters["generation_tokens"] += generated
        inter_token = self.histograms["inter_token_latency_seconds"]
        for last, count in gaps.items():
            inter_token.observe(now - last, count)

    def _first_token(self, sequence: SampledSequence) -> None:
        self.counters["prompt_tokens"] += sequence.num_prompt
        if sequence.first_token_time is not None:
            ttft = sequence.first_token_time - sequence.arrival_time
            self.histograms["time_to_first_token_seconds"].observe(max(ttft, 0.0))

    def preempted(self, count: int) -> None:
        self.counters["num_preemptions"] += count

    def parity_checked(self, mismatch: bool) -> None:
        """A finished request's log probs were scored again (``--verify-logprobs-fraction``); ``mismatch``: some
        differed."""
        self.counters["logprob_parity_checked"] += 1
        self.counters["logprob_parity_mismatch"] += mismatch

    def finish(self, record: FinalRecord) -> None:
        """A request left this engine finished (completed or aborted here), as its final record says."""
        reason = record.finish_reason.value if record.finish_reason is not None else None
        if reason in self.finished:
            self.finished[reason] += 1
        if reason == FinishReason.ABORT.value or record.arrival_time is None:
            return
        if record.finish_time is not None:
            self.histograms["e2e_request_latency_seconds"].observe(max(record.finish_time - record.arrival_time, 0.0))
        scheduled = next((e.timestamp for e in record.events if e.type is EventType.PREFILL), None)
        if scheduled is not None:
            self.histograms["request_queue_time_seconds"].observe(max(scheduled - record.arrival_time, 0.0))

    def to_wire(self, prefix_cache_queries: int, prefix_cache_hits: int) -> dict[str, Any]:
        """The heartbeat's ``metrics`` field (the prefix-cache counters live in the scheduler)."""
        counters = {**self.counters, "prefix_cache_queries": prefix_cache_queries,
                    "prefix_cache_hits": prefix_cache_hits}
        per_pos = {str(position): count for position, count in enumerate(self.accepted_per_pos)}
        return {"counters": counters, "request_success": dict(self.finished), ACCEPTED_PER_POS: per_pos,
                "histograms": {name: h.to_wire() for name, h in self.histograms.items()}}
