"""The one object the engine keeps per request: its tokens, how many are in the KV cache and where, its stop ids,
seed, adapter slot and drafts. Built once when the scheduler admits a request; the scheduler, the step plan and the
speculative decoder read and write it, and the wire request it wraps is only the record handed back."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..multimodal import cache_keys
from ..wire.expert_routing import RoutingRecord
from ..wire.prefix_hash import ROOT_HASH, salted_root
from ..wire.request import DynamicInferenceRequest


@dataclass
class Sequence:
    """Engine-side state of one request: its tokens, how many are in the cache, and where."""

    request: DynamicInferenceRequest
    max_total_tokens: int
    stop_token_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    host_tokens: int = 0  # of its cached prefix, tokens copied back from the host tier (not found on the device)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the complete blocks computed
    kv_epoch: int | None = None  # weights generation its cached KV was computed under (None: no KV yet)
    prompt_hashes: list[int] = field(default_factory=list)  # hashes of every complete block it can share
    last_token_at: float | None = None  # monotonic time of its last sampled token here (inter-token latency)
    routing: RoutingRecord | None = None  # expert ids of its processed tokens, when the request asked for them
    reads_prefix_cache: bool = True  # False: computes every token itself (its routing must be its own)
    pending_tokens: int = 0  # tokens launched steps sampled that the host has not read yet (overlapped steps)
    pending_row: int = -1  # the row of the last of them in its step's sampled tokens (the next input's source)
    verify_row: int = -1  # its request index in the verify step that sampled it last (its shift there); -1: plain
    seed: int = 0  # keys its sampling stream: its own seed, or one drawn for it when it was added
    finished: bool = False  # left the engine (finished, aborted, failed): rows of steps in flight are dropped
    prefix_root: int = ROOT_HASH  # where its chain of block hashes starts: its cache_salt's root
    lora_slot: int = -1  # the adapter slot its rows run under (engine.lora); -1: the base model
    lora_version: int = -1  # the version of its adapter in that slot (its tokens' lora_epochs); -1: none
    num_drafts: int = 0  # speculative guesses at the end of token_ids, not verified yet (engine.speculative)
    drafts_in_flight: int = 0  # guesses in token_ids of launched verify steps, not read yet (engine.speculative)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_tokens) + list(self.request.generated_tokens)
        self.prefix_root = salted_root(self.request.sampling_params.cache_salt)

    @property
    def priority(self) -> int:
        return self.request.sampling_params.priority

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_uncomputed(self) -> int:
        """Tokens to compute before it samples again: known ones, and the pending one as the last input."""
        return len(self.token_ids) + self.pending_tokens - self.num_computed

    @property
    def num_generated(self) -> int:
        """Tokens generated so far, those the steps in flight sample included (a verify step in flight counted as if
        it accepted every draft: its next step's rows are corrected on the device)."""
        return len(self.request.generated_tokens) + self.pending_tokens + self.drafts_in_flight

    @property
    def schedulable(self) -> bool:
        """Whether a step may compute for it now: one at its length limit waits for its last token."""
        return len(self.token_ids) + self.pending_tokens < self.max_total_tokens

    def cache_tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end - 1`` as the prefix cache keys them (an image's placeholders by its content)."""
        return cache_keys(self.token_ids[start:end], self.request.images, start)
