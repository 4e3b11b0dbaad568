"""The engine's bookkeeping: the requests it holds, which of them run each step (continuous batching, how many
tokens each computes), and what a finished step did to them (:meth:`Scheduler.update_from_output`).

Every step mixes one decode token per running request with chunks of prompts (chunked prefill)
up to ``max_batch_tokens``. Running requests are served first, oldest first; waiting ones are
admitted while tokens, request slots and KV blocks remain, in the order of their ``priority``
(lower first, vLLM's priority policy), then of arrival. When blocks run out, the newest running
request is preempted: its blocks are freed and it waits to be recomputed from its prompt plus the
tokens it already generated, which leaves its output unchanged. A request's prefix-cache chain
starts from its ``cache_salt`` (:func:`~megatron_serve.wire.prefix_hash.salted_root`), its adapter's and the
weights' epoch (:func:`~megatron_serve.wire.prefix_hash.epoch_root`). A prefix that stops on the device goes on
in the host tier when there is one (:mod:`.kv.offload`): those blocks are copied back, not recomputed.

A prompt with more than ``long_prefill_token_threshold`` tokens left to compute is long (vLLM's
option and its ``max_long_partial_prefills``): a step first gives at most that many tokens to each
of at most ``max_long_partial_prefills`` long prompts, and passes over the other long ones, so that
decodes and shorter prompts behind them, running or waiting, get their share of the step rather
than waiting for every chunk of a long prompt that came first (several choices of one scored
prompt). What budget is left then goes to the long prompts, running first, in order: a long prompt
alone is chunked as without the threshold. How a prompt is chunked never changes its tokens.

Requests of tenants (``SamplingParams.tenant``) are admitted by class and fair share, and a better class takes the
slot or the KV blocks of a worse one: :mod:`.tenancy`, on from the first such request (none: as above). vLLM's
``--scheduling-policy priority`` turns the same policy on from the start, with the ``priority`` value inside each
class: a waiting request of a smaller value takes the slot or blocks of a running one of a larger. Which blocks
a step takes, the cached prefix a request starts on and the blocks it publishes are :mod:`.kv.blocks`'.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..scheduling.queue_policy import QueuePolicy
from ..wire.engine_stats import EngineStats
from ..wire.expert_routing import record_step
from ..wire.request import EngineRequest, EventType, FinishReason, RequestEvent, RequestStatus
from .admission import Admission
from .drafts import restore, roll_back
from .kv.blocks import READING, SequenceBlocks
from .kv.cache import BlockAllocator
from .sampling.logprob_parity import ParityChecker
from .lora.queue import LoraQueue
from .sampling.prompt_scores import record_prompt_scores
from .sequence import Sequence
from .tenancy import TenantPolicy
from .steps import Emitted, InFlightStep, StepOutput
from .token_append import append_tokens, ended

def _priority(sequence: Sequence) -> int:
    return sequence.priority


def step_order(entry: tuple[Sequence, int]) -> tuple[bool, int]:
    """Where an entry goes in its step: decode-shaped entries (one token) first, as the step plan needs them, then
    the others; within each, by adapter slot (base rows, slot -1, first), else in the order scheduled. Laying each
    adapter's rows side by side lets the CPU LoRA kernels multiply them as one slice of the activations, with no
    gather or scatter (:mod:`megatron_kernels.reference_lora`); an engine without adapters keeps its order."""
    return entry[1] != 1, entry[0].lora_slot


@dataclass
class ScheduledBatch:
    """One step's work: ``(sequence, tokens to compute)``, decode entries (one token) first. ``displacing``: a request
    of a better band took the slot or KV blocks of a worse one in this step (:mod:`.tenancy`: one that took a slot
    computes that band alone); the engine reads such a step at once instead of overlapping the next one with it
    (``engine.core``), so that the request that asked for latency gets its first token a step sooner."""

    entries: list[tuple[Sequence, int]]
    preempted: list[Sequence]
    displacing: bool = False

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
    displaced: list[Sequence] = field(default_factory=list)  # preempted for a better band (engine.tenancy)
    left_out: set[int] = field(default_factory=set)  # ids of running requests of worse bands that sit it out
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

    def drop(self, sequence: Sequence) -> None:
        """Take ``sequence``'s share out of this step (it was preempted after it was scheduled)."""
        row = self._rows.pop(id(sequence), None)
        if row is None:
            return
        self.budget += self.counts.pop(row)
        self.sequences.pop(row)
        self._rows = {id(s): index for index, s in enumerate(self.sequences)}


class Scheduler:
    """The engine's bookkeeping, testable without a model: the requests it holds (added through ``admission``,
    aborted, handed back), which of them run each step (:meth:`schedule`), and what a finished step did to them
    (:meth:`update_from_output`: tokens appended, stop checks, prefix-cache blocks registered, rejected drafts
    rolled back). It frees what it holds of a request that leaves and calls ``forgets`` for what others hold
    (the device's sampling state, the drafter's, the image embeddings). ``parity``: the engine's own log-prob
    checks, whose requests no statistic counts."""

    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch_tokens: int, max_requests: int,
                 long_prefill_token_threshold: int = 0, max_long_partial_prefills: int = 1, *,
                 admission: Admission | None = None, stats: EngineStats | None = None,
                 parity: ParityChecker | None = None, scheduling_policy: str = "fcfs"):
        self.admission = admission
        self.stats = stats if stats is not None else EngineStats()
        self.parity = parity
        self.structured = admission.structured if admission is not None else None
        self.lora_queue = LoraQueue(admission.loras if admission is not None else None)  # waiting for an adapter slot
        self.requests: dict[str, Sequence] = {}  # every request here, by id, until it leaves
        self.pending: list[StepOutput] = []  # outputs not handed out yet (a failed admission, a step read early)
        self.forgets: list[Callable[[str], None]] = []  # called with the id of a request that leaves
        self.emitted: list[Callable[[list[StepOutput]], None]] = []  # called with outputs as they are made
        # called with a request that leaves, before its blocks are freed (a prefill engine copies them out)
        self.leaving: list[Callable[[Sequence], None]] = []
        self.allocator = allocator
        self.block_size = block_size
        self.blocks = SequenceBlocks(allocator, block_size)  # each request's blocks
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
        self.epoch = 0  # the weights' epoch served: new KV is computed under it, new tokens carry it
        # bands and fair shares, from the first request of a tenant; with vLLM's priority policy from the start
        self.tenancy = TenantPolicy(by_priority=True) if scheduling_policy == "priority" else None

    def add(self, sequence: Sequence) -> None:
        """Queue ``sequence`` behind every waiting one whose priority value is not larger (arrival order within
        a priority; the fleet's queue policy, :mod:`megatron_serve.scheduling.queue_policy`); without priorities, at
        the end. The first request of a tenant turns the tenants' policy on (:mod:`.tenancy`)."""
        if sequence.sampling_params.tenant is not None:
            if self.tenancy is None:
                self.tenancy = TenantPolicy()
            self.tenancy.added(sequence, [*self.running, *self.waiting])
        QueuePolicy.place(self.waiting, sequence, _priority)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_being_computed(self) -> set[int]:
        """Hashes of shareable blocks that running sequences have still to compute.

        A waiting request whose next uncached block is among them waits for it rather than
        computing the same prefix a second time (a burst of requests sharing a new prefix).
        """
        pending: set[int] = set()
        for sequence in self.running:
            pending.update(sequence.prompt_hashes[len(sequence.block_hashes):])
        return pending

    def _preempt_newest(self, preempted: list[Sequence]) -> Sequence:
        victim = self.running.pop()
        self.blocks.release(victim)
        victim.status = RequestStatus.WAITING_IN_QUEUE
        victim.add_event(EventType.PREEMPT)
        self.waiting.appendleft(victim)
        preempted.append(victim)
        return victim

    def _is_long(self, tokens_left: int) -> bool:
        return 0 < self.long_prefill_token_threshold < tokens_left

    def schedule(self) -> ScheduledBatch:
        threshold = self.long_prefill_token_threshold
        fair = threshold > 0
        step = _Step(self.max_batch_tokens, self.max_long_partial_prefills if fair else 0)
        tenancy = self.tenancy
        if tenancy is not None:  # the queue in bands and fair shares, and slots taken from worse bands for better
            tenancy.order(self.waiting)
            self._displace(tenancy, step)
        self._schedule_running(step, fair)
        pending = self._blocks_being_computed()
        self._admit_waiting(step, pending, fair)
        if fair and step.budget > 0:  # what is left goes to the long prompts cut short or passed over, in order
            self._grow_cut_short(step)
            self._admit_waiting(step, pending, False)
        entries = list(zip(step.sequences, step.counts))
        entries.sort(key=step_order)
        if tenancy is not None:
            tenancy.charge(entries)
            tenancy.waited(self.waiting)
        return ScheduledBatch(entries, step.displaced + step.preempted, bool(step.displaced))

    def _displace(self, tenancy: TenantPolicy, step: _Step) -> None:
        """Better bands take the slots of worse ones (:meth:`.tenancy.TenantPolicy.displace`), which go back to the
        queue with their tokens; the worse bands still running sit this step out (``TenantPolicy.left_out``)."""
        victims, displacer = tenancy.displace(self.running, self.waiting, self.max_requests - len(self.running))
        for victim in victims:
            self._displaced(tenancy, victim, step)
        step.left_out = tenancy.left_out(self.running, displacer)

    def _displaced(self, tenancy: TenantPolicy, victim: Sequence, step: _Step) -> None:
        self.blocks.release(victim)
        victim.status = RequestStatus.WAITING_IN_QUEUE
        victim.add_event(EventType.PREEMPT, "a request of a better class")
        tenancy.requeue(self.waiting, victim)
        step.displaced.append(victim)

    def _evict_for(self, sequence: Sequence, count: int, step: _Step) -> bool:
        """KV blocks ran out for waiting ``sequence``: running requests of a worse band give theirs (the worst
        band's newest first, its step's share dropped), until its ``count`` tokens fit; False if they cannot."""
        tenancy = self.tenancy
        if tenancy is None:
            return False
        while not self.blocks.fit(sequence, count):
            victim = tenancy.victim(self.running, sequence)
            if victim is None:
                return False
            self.running.pop()
            step.drop(victim)
            self._displaced(tenancy, victim, step)
        return True

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
            if not sequence.schedulable or id(sequence) in step.left_out:
                continue
            count = self._chunk(step, sequence.num_uncomputed, fair)
            if not count:
                continue
            while not self.blocks.fit(sequence, count):
                if self._preempt_newest(step.preempted) is sequence:
                    return  # the sequence itself was preempted: nothing newer is left running
            self.blocks.grow(sequence, count)
            step.add(sequence, count)

    def _grow_cut_short(self, step: _Step) -> None:
        """After the fair pass, the running prompts it cut short or passed over grow into the budget left, oldest
        first, where free blocks allow (nothing is preempted for them)."""
        for sequence in self.running:
            if step.budget <= 0:
                return
            done = step.scheduled(sequence)
            count = min(sequence.num_uncomputed - done, step.budget)
            if (sequence.schedulable and count > 0 and id(sequence) not in step.left_out
                    and self.blocks.fit(sequence, done + count)):
                self.blocks.grow(sequence, done + count)
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
            next_hash = self.blocks.attach_cached_prefix(sequence, self.epoch)
            if next_hash == READING or next_hash is not None and next_hash in pending:
                self.blocks.release(sequence)
                skipped.append(sequence)
                continue
            count = self._chunk(step, sequence.num_uncomputed, fair)
            if not self.blocks.fit(sequence, count) and not self._evict_for(sequence, count, step):
                self.blocks.release(sequence)
                self.waiting.appendleft(sequence)
                break
            cached = sequence.num_computed
            self.cached_tokens += cached - sequence.host_tokens
            self.queried_tokens += len(sequence.token_ids)
            if self.allocator.tier is not None:
                self.host_queried_tokens += len(sequence.token_ids) - (cached - sequence.host_tokens)
                self.host_cached_tokens += sequence.host_tokens
            sequence.cached_tokens = min(cached, sequence.num_prompt)
            self.blocks.grow(sequence, count)
            if self.tenancy is not None:
                self.tenancy.admitted(self.running, sequence)  # in band order (engine.tenancy)
            else:
                self.running.append(sequence)
            pending.update(sequence.prompt_hashes[len(sequence.block_hashes):])
            sequence.status = RequestStatus.ACTIVE
            sequence.add_event(EventType.PREFILL)
            step.add(sequence, count)
        self.waiting.extendleft(reversed(skipped))

    def finish(self, sequence: Sequence) -> None:
        """Remove a finished or aborted sequence from wherever it is and free its blocks."""
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self.blocks.release(sequence)

    def evict_all(self) -> list[Sequence]:
        """Move every running sequence back to waiting without blocks (suspend); returns them. A waiting one that
        holds blocks (a decode engine's prefilled request: engine.kv_transfer) lets them go too."""
        for sequence in self.waiting:
            if sequence.block_table:
                self.blocks.release(sequence)
        evicted = list(self.running)
        for sequence in reversed(evicted):
            self.blocks.release(sequence)
            sequence.status = RequestStatus.WAITING_IN_QUEUE
            sequence.add_event(EventType.EVICT)
            self.waiting.appendleft(sequence)
        self.running.clear()
        return evicted

    def take_all(self) -> list[Sequence]:
        """Remove and return every sequence, running first (oldest first), with blocks freed."""
        taken = self.running + list(self.waiting)
        for sequence in self.running:
            self.blocks.release(sequence)
        self.running.clear()
        self.waiting.clear()
        return taken

    # ------------------------------------------------------------ requests in and out
    def add_request(self, request: EngineRequest) -> None:
        """Admit a request (queued by priority, or behind its adapter's slot); one that can never run fails alone,
        its output waiting in ``pending``."""
        assert self.admission is not None, "a scheduler without admission takes sequences (add), not requests"
        added = RequestEvent(EventType.ADD, time.time())  # before the checks (a grammar compiles there)
        admitted = self.admission.admit(request, known=request.request_id in self.requests)
        if isinstance(admitted, str):
            refused = Sequence.of(request, 0, frozenset())
            refused.events.append(added)
            refused.fail(admitted)
            self._emit([ended(refused)])
            return
        sequence, registration = admitted
        sequence.events.append(added)
        self.requests[request.request_id] = sequence
        if sequence.brought_its_stop:  # generating past its stop token would double it
            sequence.complete(FinishReason.STOP)
            self._leave(sequence)
            return
        if self.parity is not None:
            self.parity.admitted(sequence)
        self.lora_queue.add(sequence, registration, self, self.requests.values())

    def abort_request(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is (rows of steps in flight for it are dropped when read); returns its sequence,
        or None if unknown."""
        sequence = self.requests.pop(request_id, None)
        if sequence is None:
            return None
        self.forget(sequence)
        if self.parity is not None:
            self.parity.abandon(request_id)
        sequence.fail("aborted", FinishReason.ABORT)
        self.stats.finish(sequence.final_record())
        return sequence

    def fail(self, sequence: Sequence, message: str) -> None:
        """A request that cannot go on (its images failed to encode): it fails alone, its output in ``pending``."""
        sequence.fail(message)
        self._leave(sequence)

    def _leave(self, sequence: Sequence) -> None:
        """A request that ends without a token here: forgotten, its output in ``pending``."""
        self.forget(sequence)
        out = ended(sequence)
        self.stats.finish(out.final)
        self._emit([out])

    def forget(self, sequence: Sequence) -> None:
        """Free what is held for a request that leaves (finished, aborted, failed)."""
        sequence.finished = True
        for leave in self.leaving:
            leave(sequence)
        self.finish(sequence)
        self.lora_queue.discard(sequence)
        self.requests.pop(sequence.request_id, None)
        if self.structured is not None:
            self.structured.remove(sequence.request_id)
        for forget in self.forgets:
            forget(sequence.request_id)

    def take_unfinished(self) -> list[Sequence]:
        """Hand back every unfinished request but the engine's own checks (draining): blocks freed, tokens kept,
        their outputs not handed out yet dropped. ``forgets`` is not called: the caller clears the rest at once."""
        taken = self.take_all() + self.lora_queue.take_all()
        parity = self.parity
        sequences = [s for s in taken if parity is None or not parity.abandon(s.request_id)]
        handed = {s.request_id for s in sequences}
        self.pending = [out for out in self.pending if out.request_id not in handed]
        self.requests.clear()
        if self.structured is not None:
            self.structured.clear()  # rebuilt from the generated tokens wherever the requests run next
        for sequence in sequences:
            sequence.status = RequestStatus.WAITING_IN_QUEUE
        return sequences

    def _emit(self, outputs: list[StepOutput]) -> None:
        """Outputs made outside a step (a refusal, a failure): kept for the next ``step()``, shown to ``emitted``."""
        for emitted in self.emitted:
            emitted(outputs)
        self.pending += outputs

    def take_pending(self) -> list[StepOutput]:
        outputs, self.pending = self.pending, []
        return outputs

    # ------------------------------------------------------------ a finished step
    def update_from_output(self, step: InFlightStep, emitted: list[Emitted]) -> list[StepOutput]:
        """The bookkeeping of a finished step, in one place: expert routing and prompt scores recorded, the KV
        blocks the step completed registered for the prefix cache (prompt chunks first, so that a request
        finishing now leaves its blocks cached), each request's tokens appended (or dropped for a request
        that left meanwhile) after its rejected drafts are rolled back, stop conditions checked, grammar
        advanced, statistics observed. Registering here rather than at launch publishes a block one step later
        under asynchronous scheduling. ``emitted``: each sampling row's tokens, as the device gave them."""
        drafts = step.drafts if step.drafts is not None else [0] * len(step.sampling)
        drafted: dict[int, np.ndarray] = {}  # speculating sequences' draft rows, recorded as drafts are accepted
        if step.routing is not None:
            counts = {id(s): k for s, k in zip(step.sampling, drafts)}
            drafted = record_step([(s, start, count, counts.get(id(s), 0)) for (s, count), start
                                   in zip(step.entries, step.starts)], np.asarray(step.routing.wait()[0]))
        if step.scores is not None:
            record_prompt_scores(*step.scores)
        for sequence, _count in step.entries:
            if not sequence.finished:
                self.blocks.register_computed(sequence, self.epoch)
        now = time.monotonic()
        sequences, outputs, observed = [], [], []
        parity = self.parity
        for row, sequence in enumerate(step.sampling):
            sequence.pending_tokens -= 1
            if sequence.finished:  # aborted or finished while the step ran: its row is dropped
                continue
            out = emitted[row]
            # the step launched after this one drafted past it: its drafts go back after this step's tokens
            later = roll_back(sequence, drafts[row], out.accepted, self.blocks)
            outputs.append(append_tokens(sequence, out, (self.epoch, step.kv_epochs[row]), self.structured,
                                         drafted.get(id(sequence))))
            if outputs[-1].finished:
                self.forget(sequence)
            if parity is None or not (parity.active and parity.owns(sequence.request_id)):  # no user request
                sequences.append(sequence)
                observed.append(outputs[-1])
            if not sequence.finished:
                if later:
                    restore(sequence, later)
                self.blocks.register_computed(sequence, self.epoch)
        self.stats.observe_step(sequences, observed, now)
        for emitted in self.emitted:
            emitted(outputs)
        return outputs

