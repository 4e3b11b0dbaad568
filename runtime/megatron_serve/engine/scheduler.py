"""Continuous batching: which requests run this step, and how many tokens each computes.

Every step mixes one decode token per running request with chunks of prompts (chunked prefill)
up to ``max_batch_tokens``. Running requests are served first, oldest first; waiting ones are
admitted while tokens, request slots and KV blocks remain, in the order of their ``priority``
(lower first, vLLM's priority policy), then of arrival. When blocks run out, the newest running
request is preempted: its blocks are freed and it waits to be recomputed from its prompt plus the
tokens it already generated, which leaves its output unchanged. A request's prefix-cache chain
starts from its ``cache_salt`` (:func:`~megatron_serve.wire.prefix_hash.salted_root`), its adapter's and the
weights' epoch (:func:`~megatron_serve.wire.prefix_hash.epoch_root`). A prefix that stops on the device goes on
in the host tier when there is one (:mod:`.kv_offload`): those blocks are copied back, not recomputed.

A prompt with more than ``long_prefill_token_threshold`` tokens left to compute is long (vLLM's
option and its ``max_long_partial_prefills``): a step first gives at most that many tokens to each
of at most ``max_long_partial_prefills`` long prompts, and passes over the other long ones, so that
decodes and shorter prompts behind them, running or waiting, get their share of the step rather
than waiting for every chunk of a long prompt that came first (several choices of one scored
prompt). What budget is left then goes to the long prompts, running first, in order: a long prompt
alone is chunked as without the threshold. How a prompt is chunked never changes its tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..wire.expert_routing import RoutingRecord
from .kv_cache import BlockAllocator, blocks_for_tokens
from ..multimodal import cache_keys
from ..wire.prefix_hash import ROOT_HASH, block_hashes, chain_hash, epoch_root, salted_root
from ..wire.request import DynamicInferenceRequest, EventType, RequestStatus


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


def step_order(entry: tuple[Sequence, int]) -> tuple[bool, int]:
    """Where an entry goes in its step: decode-shaped entries (one token) first, as the step plan needs them, then
    the others; within each, by adapter slot (base rows, slot -1, first), else in the order scheduled. Laying each
    adapter's rows side by side lets the CPU LoRA kernels multiply them as one slice of the activations, with no
    gather or scatter (:mod:`megatron_kernels.reference_lora`); an engine without adapters keeps its order."""
    return entry[1] != 1, entry[0].lora_slot


@dataclass
class ScheduledBatch:
    """One step's work: ``(sequence, tokens to compute)``, decode entries (one token) first."""

    entries: list[tuple[Sequence, int]]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(count for _, count in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass
class _Step:
    """One step's schedule as it is built: the tokens left, each sequence's count so far, long prompts' turns."""

    budget: int
    long_turns: int  # long prompts the fair pass may still give a chunk to
    sequences: list[Sequence] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    _rows: dict[int, int] = field(default_factory=dict)  # id(sequence) -> its row in sequences

    def scheduled(self, sequence: Sequence) -> int:
        row = self._rows.get(id(sequence))
        return 0 if row is None else self.counts[row]

    def add(self, sequence: Sequence, count: int) -> None:
        row = self._rows.get(id(sequence))
        if row is None:
            self._rows[id(sequence)] = len(self.sequences)
            self.sequences.append(sequence)
            self.counts.append(count)
        else:
            self.counts[row] += count
        self.budget -= count


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch_tokens: int, max_requests: int,
                 long_prefill_token_threshold: int = 0, max_long_partial_prefills: int = 1):
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_requests = max_requests
        self.long_prefill_token_threshold = long_prefill_token_threshold  # 0: no prompt is long (off)
        self.max_long_partial_prefills = max_long_partial_prefills
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.cached_tokens = 0  # tokens admitted sequences skipped thanks to the device prefix cache
        self.queried_tokens = 0  # tokens admitted sequences looked up in the prefix cache (vLLM's "queries")
        self.host_queried_tokens = 0  # of those, tokens not found on the device, looked up in the host tier
        self.host_cached_tokens = 0  # tokens admitted sequences copied back from the host tier instead of computing
        self.epoch = 0  # the weights' epoch new KV is computed under (the engine's, set before each schedule)

    def add(self, sequence: Sequence) -> None:
        """Queue ``sequence`` behind every waiting one whose priority value is not larger (arrival order within
        a priority); without priorities, at the end."""
        waiting = self.waiting
        if not waiting or waiting[-1].priority <= sequence.priority:
            waiting.append(sequence)
            return
        index = len(waiting) - 1
        while index and waiting[index - 1].priority > sequence.priority:
            index -= 1
        waiting.insert(index, sequence)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, sequence: Sequence, num_tokens: int) -> int:
        return blocks_for_tokens(sequence.num_computed + num_tokens, self.block_size) - len(sequence.block_table)

    def _grow(self, sequence: Sequence, num_tokens: int) -> None:
        needed = self._blocks_needed(sequence, num_tokens)
        if needed > 0:
            sequence.block_table.extend(self.allocator.allocate(needed))

    def release(self, sequence: Sequence) -> None:
        """Drop a sequence's blocks; it must be recomputed from scratch to run again."""
        self.allocator.free(sequence.block_table)
        sequence.block_table = []
        sequence.block_hashes = []
        sequence.prompt_hashes = []
        sequence.num_computed = 0
        sequence.host_tokens = 0
        sequence.kv_epoch = None

    def _attach_cached_prefix(self, sequence: Sequence) -> int | None:
        """Start a sequence on the longest cached chain of its blocks.

        Returns the hash of its first block that is not cached (None when all shareable blocks
        are). The last token is always computed (its logits are needed), so it is never matched.
        A request that still needs prompt log probs reads nothing from the cache: the positions it
        would skip must be scored (vLLM's choice too); it still publishes its blocks for others.
        A request that records its expert routing reads nothing either (its routing must be its own).
        """
        if (not self.allocator.enable_prefix_caching or sequence.num_computed or not sequence.reads_prefix_cache
                or sequence.request.prompt_scores_missing or self.epoch < 0):  # -1: a mix of weights, nothing shared
            return None
        cacheable = (len(sequence.token_ids) - 1) // self.block_size
        sequence.prompt_hashes = hashes = block_hashes(sequence.cache_tokens(0, cacheable * self.block_size),
                                                       self.block_size, epoch_root(sequence.prefix_root, self.epoch))
        blocks = self.allocator.lookup(hashes)
        self.allocator.acquire(blocks)
        on_device = len(blocks)
        tier = self.allocator.tier
        if tier is not None and on_device < cacheable:
            slots = tier.take(hashes[on_device : on_device + self.allocator.num_free])
            if slots:
                loaded = self.allocator.allocate(len(slots))
                tier.load(slots, loaded)
                for block, block_hash in zip(loaded, hashes[on_device:]):
                    self.allocator.register(block, block_hash)
                blocks += loaded
                sequence.host_tokens = len(slots) * self.block_size
        if blocks:
            sequence.block_table = list(blocks)
            sequence.block_hashes = hashes[: len(blocks)]
            sequence.num_computed = len(blocks) * self.block_size
        return hashes[len(blocks)] if len(blocks) < cacheable else None

    def _blocks_being_computed(self) -> set[int]:
        """Hashes of shareable blocks that running sequences have still to compute.

        A waiting request whose next uncached block is among them waits for it rather than
        computing the same prefix a second time (a burst of requests sharing a new prefix).
        """
        pending: set[int] = set()
        for sequence in self.running:
            pending.update(sequence.prompt_hashes[len(sequence.block_hashes):])
        return pending

    def register_computed_blocks(self, sequence: Sequence) -> None:
        """Publish the sequence's newly completed blocks whose tokens the host knows to the prefix cache (drafts
        not verified yet are not known: their rows may be rolled back)."""
        epoch = self.epoch if sequence.kv_epoch is None else sequence.kv_epoch
        if not self.allocator.enable_prefix_caching or epoch < 0:  # -1: a mix of weights, nothing to share
            return
        size = self.block_size
        known = len(sequence.token_ids) - sequence.num_drafts - sequence.drafts_in_flight
        for index in range(len(sequence.block_hashes), min(sequence.num_computed, known) // size):
            parent = sequence.block_hashes[-1] if sequence.block_hashes else epoch_root(sequence.prefix_root, epoch)
            block_hash = chain_hash(parent, sequence.cache_tokens(index * size, (index + 1) * size))
            sequence.block_hashes.append(block_hash)
            self.allocator.register(sequence.block_table[index], block_hash)

    def _preempt_newest(self, preempted: list[Sequence]) -> Sequence:
        victim = self.running.pop()
        self.release(victim)
        victim.request.status = RequestStatus.WAITING_IN_QUEUE
        victim.request.add_event(EventType.PREEMPT)
        self.waiting.appendleft(victim)
        preempted.append(victim)
        return victim

    def _is_long(self, tokens_left: int) -> bool:
        return 0 < self.long_prefill_token_threshold < tokens_left

    def schedule(self) -> ScheduledBatch:
        threshold = self.long_prefill_token_threshold
        fair = threshold > 0
        step = _Step(self.max_batch_tokens, self.max_long_partial_prefills if fair else 0)
        self._schedule_running(step, fair)
        pending = self._blocks_being_computed()
        self._admit_waiting(step, pending, fair)
        if fair and step.budget > 0:  # what is left goes to the long prompts cut short or passed over, in order
            self._grow_cut_short(step)
            self._admit_waiting(step, pending, False)
        entries = list(zip(step.sequences, step.counts))
        entries.sort(key=step_order)
        return ScheduledBatch(entries, step.preempted)

    def _chunk(self, step: _Step, tokens_left: int, fair: bool) -> int:
        """Tokens of a sequence with ``tokens_left`` to compute that this pass schedules (0: passed over): in the
        fair pass, a long prompt gets at most the threshold, and only while a long prompt's turn is left."""
        if fair and self._is_long(tokens_left):
            if not step.long_turns:
                return 0
            step.long_turns -= 1
            return min(self.long_prefill_token_threshold, step.budget)
        return min(tokens_left, step.budget)

    def _schedule_running(self, step: _Step, fair: bool) -> None:
        """Running sequences, oldest first; when blocks run out, the newest running one is preempted."""
        index = 0
        while index < len(self.running) and step.budget > 0:
            sequence = self.running[index]
            index += 1
            if not sequence.schedulable:
                continue
            count = self._chunk(step, sequence.num_uncomputed, fair)
            if not count:
                continue
            while self._blocks_needed(sequence, count) > self.allocator.num_free:
                if self._preempt_newest(step.preempted) is sequence:
                    return  # the sequence itself was preempted: nothing newer is left running
            self._grow(sequence, count)
            step.add(sequence, count)

    def _grow_cut_short(self, step: _Step) -> None:
        """After the fair pass, the running prompts it cut short or passed over grow into the budget left, oldest
        first, where free blocks allow (nothing is preempted for them)."""
        for sequence in self.running:
            if step.budget <= 0:
                return
            done = step.scheduled(sequence)
            count = min(sequence.num_uncomputed - done, step.budget)
            if (sequence.schedulable and count > 0
                    and self._blocks_needed(sequence, done + count) <= self.allocator.num_free):
                self._grow(sequence, done + count)
                step.add(sequence, count)

    def _admit_waiting(self, step: _Step, pending: set[int], fair: bool) -> None:
        """Admit waiting sequences in order while tokens, request slots and blocks remain; in the fair pass, the
        long prompts beyond their turns are passed over and keep their places."""
        skipped: list[Sequence] = []
        while self.waiting and step.budget > 0 and not step.preempted and len(self.running) < self.max_requests:
            if self.waiting[0].pending_tokens:  # preempted while a step samples for it: admitted once it lands
                break
            sequence = self.waiting.popleft()
            if fair and self._is_long(sequence.num_uncomputed) and not step.long_turns:
                skipped.append(sequence)  # judged by its whole length: no prefix-cache lookup for it
                continue
            next_hash = self._attach_cached_prefix(sequence)
            if next_hash is not None and next_hash in pending:
                self.release(sequence)
                skipped.append(sequence)
                continue
            count = self._chunk(step, sequence.num_uncomputed, fair)
            if self._blocks_needed(sequence, count) > self.allocator.num_free:
                self.release(sequence)
                self.waiting.appendleft(sequence)
                break
            cached = sequence.num_computed
            self.cached_tokens += cached - sequence.host_tokens
            self.queried_tokens += len(sequence.token_ids)
            if self.allocator.tier is not None:
                self.host_queried_tokens += len(sequence.token_ids) - (cached - sequence.host_tokens)
                self.host_cached_tokens += sequence.host_tokens
            sequence.request.cached_tokens = min(cached, len(sequence.request.prompt_tokens))
            self._grow(sequence, count)
            self.running.append(sequence)
            pending.update(sequence.prompt_hashes[len(sequence.block_hashes):])
            sequence.request.status = RequestStatus.ACTIVE
            sequence.request.add_event(EventType.PREFILL)
            step.add(sequence, count)
        self.waiting.extendleft(reversed(skipped))

    def finish(self, sequence: Sequence) -> None:
        """Remove a finished or aborted sequence from wherever it is and free its blocks."""
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self.release(sequence)

    def evict_all(self) -> list[Sequence]:
        """Move every running sequence back to waiting without blocks (suspend); returns them. A waiting one that
        holds blocks (a decode engine's prefilled request: engine.kv_transfer) lets them go too."""
        for sequence in self.waiting:
            if sequence.block_table:
                self.release(sequence)
        evicted = list(self.running)
        for sequence in reversed(evicted):
            self.release(sequence)
            sequence.request.status = RequestStatus.WAITING_IN_QUEUE
            sequence.request.add_event(EventType.EVICT)
            self.waiting.appendleft(sequence)
        self.running.clear()
        return evicted

    def take_all(self) -> list[Sequence]:
        """Remove and return every sequence, running first (oldest first), with blocks freed."""
        taken = self.running + list(self.waiting)
        for sequence in self.running:
            self.release(sequence)
        self.running.clear()
        self.waiting.clear()
        return taken
