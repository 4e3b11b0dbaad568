"""The one object the engine keeps per request: its tokens, how many are in the KV cache and where, its stop ids,
seed, adapter slot and drafts, and how it goes (status, events). Built once from the immutable ``EngineRequest`` when
the scheduler admits a request (:meth:`Sequence.of`); the scheduler, the step plan and the speculative decoder read
and write it, and what a step adds leaves it as that step's output (:class:`~.steps.StepOutput`): it keeps no
per-token list for anyone else, and its record once it leaves is :meth:`Sequence.final_record`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..multimodal import PromptImage, cache_keys
from ..wire.expert_routing import RoutingCapture
from ..wire.deltas import PromptScores
from ..wire.prefix_hash import ROOT_HASH, salted_root
from ..wire.request import (EngineRequest, EventType, FinalRecord, FinishReason, RequestEvent, RequestStatus,
                            fail_timeline, stamp_event)
from ..wire.sampling_params import SamplingParams


@dataclass(slots=True)
class Sequence:
    """Engine-side state of one request: its tokens, how many are in the cache, and where."""

    request_id: str
    sampling_params: SamplingParams
    token_ids: list[int]  # the prompt, the tokens generated, then the drafts not verified yet (engine.speculative)
    num_prompt: int
    max_total_tokens: int
    stop_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.time)
    images: list[PromptImage] = field(default_factory=list)  # placed in the prompt (vision-language models)
    events: list[RequestEvent] = field(default_factory=list)
    num_output: int = 0  # tokens generated (by engines before this one too), after the prompt in token_ids
    status: RequestStatus = RequestStatus.WAITING_IN_QUEUE
    finish_reason: FinishReason | None = None
    error: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at its last admission
    num_scored: int = 0  # prompt positions scored (return_prompt_log_probs), kept over a preemption
    prompt_scores: PromptScores | None = None  # the scores made, until its first output carries them
    num_computed: int = 0
    host_tokens: int = 0  # of its cached prefix, tokens copied back from the host tier (not found on the device)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the complete blocks computed
    kv_epoch: int | None = None  # weights generation its cached KV was computed under (None: no KV yet)
    prompt_hashes: list[int] = field(default_factory=list)  # hashes of every complete block it can share
    last_token_at: float | None = None  # monotonic time of its last sampled token here (inter-token latency)
    routing: RoutingCapture | None = None  # its processed tokens' expert ids not delivered yet, when asked for
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
    waited_steps: int = 0  # a tenant's request: steps it waited since it last ran (engine.tenancy promotes it)

    def __post_init__(self) -> None:
        self.prefix_root = salted_root(self.sampling_params.cache_salt)

    @classmethod
    def of(cls, request: EngineRequest, max_total_tokens: int, stop_token_ids: frozenset[int]) -> "Sequence":
        """The sequence of a request as an engine receives it: a continuation goes on from the tokens it brings."""
        prompt = request.prompt_tokens
        return cls(request.request_id, request.sampling_params, [*prompt, *request.generated_tokens], len(prompt),
                   max_total_tokens, stop_token_ids, request.arrival_time,
                   [PromptImage(image.data, image.offset, image.length) for image in request.images],
                   list(request.events), len(request.generated_tokens))

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def prompt_tokens(self) -> list[int]:
        return self.token_ids[: self.num_prompt]

    @property
    def output_tokens(self) -> list[int]:
        """The tokens generated so far (without drafts)."""
        return self.token_ids[self.num_prompt : self.num_prompt + self.num_output]

    @property
    def brought_its_stop(self) -> bool:
        """A continuation whose last generated token is one of its stop ids (past ``min_tokens``): it ended where it
        ran before (its stop token reached the client, the end did not), so it ends here without a token."""
        n = self.num_output
        return n >= max(self.sampling_params.min_tokens, 1) and self.token_ids[self.num_prompt + n - 1] in \
            self.stop_token_ids

    @property
    def num_uncomputed(self) -> int:
        """Tokens to compute before it samples again: known ones, and the pending one as the last input."""
        return len(self.token_ids) + self.pending_tokens - self.num_computed

    @property
    def num_generated(self) -> int:
        """Tokens generated so far, those the steps in flight sample included (a verify step in flight counted as if
        it accepted every draft: its next step's rows are corrected on the device)."""
        return self.num_output + self.pending_tokens + self.drafts_in_flight

    @property
    def schedulable(self) -> bool:
        """Whether a step may compute for it now: one at its length limit waits for its last token."""
        return len(self.token_ids) + self.pending_tokens < self.max_total_tokens

    @property
    def prompt_scores_missing(self) -> int:
        """Prompt positions still to score for ``return_prompt_log_probs`` (0 when not asked for or done)."""
        if not self.sampling_params.return_prompt_log_probs:
            return 0
        return max(self.num_prompt - 1 - self.num_scored, 0)

    def cache_tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end - 1`` as the prefix cache keys them (an image's placeholders by its content)."""
        return cache_keys(self.token_ids[start:end], self.images, start)

    # ------------------------------------------------------------ how it goes
    def add_event(self, event_type: EventType, detail: str | None = None) -> None:
        stamp_event(self, event_type, detail)

    def complete(self, reason: FinishReason) -> None:
        self.status = RequestStatus.COMPLETED
        self.finish_reason = reason
        self.add_event(EventType.FINISH, reason.value)

    def fail(self, message: str, reason: FinishReason = FinishReason.ERROR) -> None:
        fail_timeline(self, message, reason)

    def final_record(self) -> FinalRecord:
        """Its record as it leaves the engine, without what travelled in its outputs or its prompt (the receiver
        has them)."""
        return FinalRecord(request_id=self.request_id, cached_tokens=self.cached_tokens, status=self.status,
                           finish_reason=self.finish_reason, error=self.error, events=list(self.events),
                           arrival_time=self.arrival_time, first_token_time=self.first_token_time,
                           finish_time=self.finish_time)
