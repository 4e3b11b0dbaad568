"""The engine's side of speculation: drafts attached before scheduling, verified after the forward, KV rolled back.

One speculative step, in the engine's ``schedule -> launch -> sample -> finish`` seam:

1. ``propose``: each running request that may speculate (one token left to compute, on the host or sampled
   by the step in flight) gets up to ``K`` guesses from the proposer, ``K`` chosen
   per request and step by the policy of :mod:`.adaptive` (at most ``num_speculative_tokens``; 0: none),
   cut at the first one its grammar refuses (a request with structured outputs), appended to its
   ``token_ids`` and counted in ``num_drafts``. The scheduler then sees ``1 + drafts``
   tokens to compute, as for a prefill chunk, and gives the request that many query rows.
2. ``fit``: what the scheduler could not take (a token budget cut, a preemption) loses its drafts, so a
   request's uncomputed tokens are exactly the rows it runs. ``step_plan`` lists the draft rows' logits
   (``num_verify``) beside the sampling row.
3. ``launch_verify`` (at launch) and ``read`` (in ``finish``, one step later when overlapped): every depth's
   row is sampled in one pass with the engine's own sampler, logit controls and
   seeded streams, as if each were an ordinary decode step after the drafts before it: depth ``j`` draws the
   token at position ``start + 1 + j``, keyed on (seed, sample index, position) and with the penalties'
   counts of every token before it (the request's output, then the drafts before ``j``). A draft is accepted when the token drawn equals it; the first token that differs is the
   bonus token and ends the request's run. Greedy, that is "argmax equal". Sampled, it is rejection
   sampling for a point-mass draft (every proposer here proposes deterministically): the draft ``d`` is
   accepted with probability ``p(d)``, and on rejection the token is distributed as ``p`` without ``d``,
   renormalised, which is ``max(0, p - q)`` normalised for ``q = δ_d``. Either way each emitted token is the
   one the non-speculative engine draws at that position: outputs, log probs, top log probs and
   ``logprobs-mode`` variants are those of a run without speculation, token for token. A grammar's mask
   applies at every depth, each the mask of the state after the drafts before it
   (:meth:`~..structured_output.StructuredOutputs.bitmask` with drafts), as the plain engine applies it at
   that position.
4. ``roll_back`` (the scheduler's, by counts: :mod:`..drafts`): the rejected drafts leave ``token_ids``,
   ``num_computed`` drops to the verified tokens, and KV blocks past the request's tokens go back to the pool. Blocks are published to the prefix cache only up
   to the verified tokens (``SequenceBlocks.register_computed`` stops before drafts).

Overlapped verify steps (``async_scheduling``, vLLM v1's async scheduling with speculation): the next step is
planned and launched before a verify step is read. The host plans it as if every draft of the step in flight
were accepted (``num_computed`` and ``token_ids`` already include them, ``drafts_in_flight`` counts them), and a
request drafting again asks the proposer for ``K + 1`` guesses past them, the first standing for the token in
flight (the bonus token, unknown to the host), so its drafts follow that token in ``token_ids`` (``step_plan``
gathers the token itself into the first row on the device). On the device, ``launch_verify`` counts each
request's accepted drafts ``a`` (the first depth whose draw differs from its draft) and keeps ``shift = K - a``;
the runner moves the next step's rows of that request back by it (positions, sequence length, cache slots from
the block table, the gathered token's index: the bonus token sits at depth ``a``), and the sampler's seeded
streams and generated counts move back with them, so every draw is the one at its true position: the output is
the plain engine's, token for token. Drafts guessed past wrong assumptions are merely worse guesses, rejected
like any other. When the step in flight is read, ``roll_back`` takes the later step's drafts off the end of
``token_ids``, removes the rejected drafts, appends the emitted tokens and ``restore`` puts the later drafts
back; a request that finished (stop token, EOS, length) or left meanwhile has its later rows dropped. Where the
next step cannot be planned this way, a verify step reads the step in flight first and is read at once
(``verify``): the fallbacks are listed in :meth:`Speculator.overlaps`.

Cost: one sampler pass and one read over ``1 + K`` rows per request, instead of one row: the rows past a
rejection are drawn in vain. On a GPU they cost next to nothing, and a pass per depth cost a device round trip
each; on a CPU each row costs compute, which the K policy's measured step cost counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Container, Iterable

import torch

from ..sampling.logits_processors import apply_controls, apply_token_bitmask
from ...wire.engine_stats import EngineStats
from ..steps import Emitted, InFlightStep, Verification
from .adaptive import AdaptiveK, PinnedK
from .proposer import DraftInput, Proposer

if TYPE_CHECKING:
    from ..sampling.sampler import Sampler
    from ..sampling.sampling_state import SamplingState, StepRows
    from ..scheduler import ScheduledBatch
    from ..sequence import Sequence


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without waiting for the work queued there (pinned on a GPU: a
    pageable copy would wait for the forward in flight, which an overlapped step must not)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class _PlainRun:
    """Plain steps timed as one sample (:meth:`Speculator.end_step`): when the first began, how many are wanted,
    and the rows and count of those that ended so far."""

    started: float
    length: int
    rows: int = 0
    steps: int = 0


class Speculator:
    """Owns the proposer and the per-step draft bookkeeping of one engine (see the module docstring)."""

    def __init__(self, proposer: Proposer, num_speculative_tokens: int, stats: EngineStats, adaptive: bool = True,
                 cpu: bool = True, overlap: bool = True):
        """``cpu``: the engine runs on a CPU, where a step's cost is its CPU time (the wall clock there also counts
        the other processes sharing the cores); on an accelerator the host waits for the device, so the wall clock
        is the cost. ``overlap``: the engine may launch a verify step before the step in flight is read (the
        engine's fallbacks of :meth:`overlaps`: overlapped scheduling on, one rank, no images)."""
        self.proposer = proposer
        self.overlap = overlap
        self.k = num_speculative_tokens
        self.stats = stats  # the engine's counters: drafts, draft tokens, accepted tokens (also per position)
        self.policy: AdaptiveK | PinnedK = AdaptiveK(self.k) if adaptive else PinnedK(self.k)
        self._clock: Callable[[], float] = time.process_time if cpu else time.perf_counter  # a step's cost
        self._started: float | None = None  # when this engine step began, by that clock
        self._timed: tuple[int, int] | None = None  # this step's (decode rows, drafts) when all its rows decode
        self._run: _PlainRun | None = None  # plain steps timed together (:meth:`end_step`)
        self._rest = 0  # steps the policy may skip (:meth:`resting`), for a batch of ``_rest_rows`` rows
        self._rest_rows = 0
        self._rested: _PlainRun | None = None  # the steps skipped so far, timed together
        self.overlapped_verify_steps = 0  # verify steps launched while the step before was in flight

    @staticmethod
    def may_speculate(sequence: "Sequence") -> bool:
        """A decode-ready request (one token left to compute: on the host, or sampled by the step in flight),
        with room for at least one draft."""
        known = len(sequence.token_ids) + sequence.pending_tokens
        return not sequence.finished and sequence.num_computed == known - 1 and known + 1 < sequence.max_total_tokens

    def begin(self, running: list["Sequence"], waiting: Iterable["Sequence"], structured: Container[str]
              ) -> tuple[dict[str, int] | None, bool]:
        """An engine step begins: the K policy puts each decode-ready request's drafts in it (:meth:`plan`: each
        drafting request's K, by request id) and says whether that verify step is read at once (not
        :meth:`overlaps`). None for the K's while the policy rests (:meth:`resting`: a plain step, not timed, with
        no :meth:`end_step`); none drafting (empty): a plain step, which costs what a step without speculation
        costs. ``structured``: the ids of the requests with a grammar."""
        if self.resting(len(running)):
            return None, False
        ks = self.plan(running)
        self.start_step(bool(ks))
        return ks, bool(ks) and not self.overlaps(ks, running, waiting, structured)

    def plan(self, running: list["Sequence"]) -> dict[str, int]:
        """This step's K of each decode-ready request that drafts (:mod:`.adaptive`), by request id; empty when
        none does (then the engine runs a plain step, overlapped, and the drafter is not called). Chosen before
        the step in flight is read: a request's room left counts the token that step samples for it."""
        self.wake()
        ids, caps = [], []  # one pass, :meth:`may_speculate` inlined: it runs every step for every row (at 64
        for s in running:  # rows the plan cost 23 us a step with a call and three lists per row, 0.9% of a CPU step)
            known = len(s.token_ids) + s.pending_tokens
            if not s.finished and s.num_computed == known - 1 and known + 1 < s.max_total_tokens:
                ids.append(s.request_id)
                caps.append(s.max_total_tokens - known - 1)
        if not ids:
            return {}
        self.stats.counters["spec_decode_num_rows"] += len(ids)
        ks = self.policy.choose(ids, caps)
        if any(ks):
            return {r: k for r, k in zip(ids, ks) if k}
        if len(ids) == len(running):  # every row declined, and every running row decodes: rows that stay put
            self._rest, self._rest_rows = self.policy.restful_steps(), len(ids)
        return {}

    def resting(self, rows: int) -> bool:
        """Whether this step may skip the K policy (and :meth:`plan`, :meth:`start_step`, :meth:`end_step`): the
        last choice declined every row and stands this step too (:meth:`~.adaptive.AdaptiveK.restful_steps`), the
        running rows unchanged (``rows``; a request that leaves wakes it, :meth:`forget`). The steps skipped are
        timed together, one plain sample, as a run of plain steps is (:meth:`end_step`)."""
        if not self._rest:
            return False
        if rows != self._rest_rows:
            self.wake()
            return False
        if self._rested is None:
            self._rested = _PlainRun(self._clock(), self._rest, rows)
            self._run = None  # a run of timed steps open before would span the skipped steps too
        self._rest -= 1
        self._rested.steps += 1
        return True

    def overlaps(self, ks: dict[str, int], running: list["Sequence"], waiting: Iterable["Sequence"],
                 structured: Container[str]) -> bool:
        """Whether this verify step (``ks``: each drafting request's K) may be launched before the step in flight is
        read: the fallbacks, in one place. Each is a case where the next step's rows could not be planned without
        the host knowing how many drafts the step in flight accepted, where its drafts would be guessed too blindly,
        or whose correction on the device this engine does not make:

        - a drafting request whose drafts the step in flight verifies: drafted past them, its drafts would assume
          every one kept and the token after them guessed, and each step's drafts would build on the last one's
          assumption, so that once one failed hardly any would be accepted (the figures are in
          ``docs/speculative.md``). Past a plain step's token only that token is guessed (a request's first verify
          step, one after K = 0);
        - the engine's own (``overlap`` false): no overlapped scheduling (``async_scheduling: false``: nothing is
          left in flight anyway), tensor parallelism (the other ranks would need the correction too), a
          vision-language model (image rows and multimodal rotary positions are placed on the host);
        - a proposer that reads the target's hidden states (MTP, EAGLE-3): it drafts from the rows just read;
        - a running or waiting request with a grammar (``structured``: its masks need its tokens on the host),
          recording its expert routing (recorded per verified position), or asking for prompt log probs (score
          rows).

        A preemption in the step needs no fallback: the preempted request loses its new drafts, and the step in
        flight's tokens are appended to it when read, its KV recomputed later like any preempted request's.
        """
        if any(s.drafts_in_flight for s in running if s.request_id in ks):
            return False
        if not self.overlap or self.proposer.reads_hidden_states:
            return False
        return not any(s.request_id in structured or s.routing is not None or s.prompt_scores_missing
                       for queue in (running, waiting) for s in queue)

    def launched(self, batch: "ScheduledBatch | None", launched: InFlightStep, previous: InFlightStep | None,
                 drafting: bool) -> None:
        """A step was launched (``previous``: the step in flight before it, if any; ``drafting``: some request
        drafts in it): a proposer that reads the target's hidden states files its rows, and an all-decode plain
        step launched after a plain one is timed for the K policy (after a verify step it also reads that one)."""
        self.observe(launched.entries, launched.starts)
        if launched.drafts is not None and previous is not None:
            self.overlapped_verify_steps += 1
        elif (not drafting and previous is not None and previous.drafts is None and batch is not None
              and batch.num_tokens == len(batch.entries)):
            self.time_step(len(batch.entries), 0)

    def wake(self) -> None:
        """The steps skipped so far (:meth:`resting`) are reported: to the policy, as the declines and the plain
        sample they are, and to the counters, as rows that could speculate."""
        rested, self._rested, self._rest = self._rested, None, 0
        if rested is None:
            return
        self.policy.rested(rested.steps)
        self.stats.counters["spec_decode_num_rows"] += rested.rows * rested.steps
        if rested.steps == rested.length:  # complete: the clock reads the start of the step after the last
            self.policy.step_cost(rested.rows, 0, (self._clock() - rested.started) / rested.steps)

    def propose(self, running: list["Sequence"], ks: dict[str, int],
                allowed: Callable[[str, list[int], frozenset[int]], int] | None = None) -> None:
        """Ask the proposer for the drafts of each running request that :meth:`plan` gave a K (and still may
        speculate), and append them to its tokens (``num_drafts``). A request whose last token the step in flight
        samples (a verify step's: after its drafts, taken as accepted) asks for ``K + 1`` guesses from the tokens
        the host has: the first stands for the token in flight, the others are the drafts, verified at their true
        positions whatever that token turns out to be (a wrong guess is only rejected). ``allowed``:
        how many of a request's drafts (by its id, the drafts and its stop tokens) its grammar accepts in a row
        (:meth:`~..structured_output.StructuredOutputs.draft_prefix`); the rest are cut."""
        candidates = [s for s in running if s.request_id in ks and self.may_speculate(s)]
        if not candidates:
            return
        # A request whose last token is still in flight drafts past it: the proposer's first guess stands for it.
        inputs = [DraftInput(s.request_id, list(s.token_ids), ks[s.request_id] + s.pending_tokens) for s in candidates]
        answered = False
        for sequence, item, drafts in zip(candidates, inputs, self.proposer.propose(inputs)):
            drafts = list(drafts[sequence.pending_tokens : item.num_tokens])
            if allowed is not None and drafts:
                del drafts[allowed(sequence.request_id, drafts, sequence.stop_token_ids):]
            sequence.token_ids.extend(drafts)
            sequence.num_drafts = len(drafts)
            self.policy.proposed(sequence.request_id, len(drafts))
            answered = answered or bool(drafts)
        if not answered:
            self.policy.unanswered()

    def observe(self, entries: list[tuple["Sequence", int]], starts: list[int]) -> None:
        """Tell the proposer which rows the target's forward just ran (``launch``'s entries, in row order), when
        it reads the target's hidden states."""
        if self.proposer.reads_hidden_states:
            self.proposer.observe([(s.request_id, start, count) for (s, count), start in zip(entries, starts)])

    def fit(self, batch: "ScheduledBatch | None", running: list["Sequence"], preempted: list["Sequence"]) -> None:
        """Drop the drafts the scheduler did not give rows to: a cut chunk keeps ``count - 1``, others none.
        A step with drafts whose rows all decode is timed for the K policy's cost model (it also finishes the step
        before it, as an overlapped plain step does; a fallback verify step first). One whose proposer drafted
        nothing is not: it is neither what a plain step costs (that one is overlapped) nor what drafting costs;
        the policy counts such offers (:meth:`~.adaptive.AdaptiveK.proposed`)."""
        scheduled = {id(s): count for s, count in batch.entries} if batch is not None else {}
        drafts = 0
        for sequence in [*running, *preempted]:
            if sequence.num_drafts:
                keep = max(scheduled.get(id(sequence), 0) - 1, 0) if sequence.num_computed else 0
                drop = sequence.num_drafts - min(keep, sequence.num_drafts)
                if drop:
                    del sequence.token_ids[len(sequence.token_ids) - drop:]
                    sequence.num_drafts -= drop
                drafts += sequence.num_drafts
        if drafts and batch is not None and batch.num_tokens == len(batch.entries) + drafts:  # every row decodes
            self.time_step(len(batch.entries), drafts)  # (no chunk of a prompt: each row is its token and drafts)

    def start_step(self, drafting: bool) -> None:
        """An engine step begins (after :meth:`plan`, which costs the same in every step): its clock starts
        (:meth:`end_step` reads it) when the K policy wants the step's cost (:meth:`~.adaptive.AdaptiveK.times_step`;
        ``adaptive: false`` learns nothing): a step alone, or a plain one as the first of a run timed together."""
        self._timed = self._started = None
        timing = self.policy.times_step(drafting)
        if timing > 1:  # one of a run of plain steps: the run's clock started at its first
            if self._run is None:
                self._run = _PlainRun(self._clock(), timing)
            return
        self._run = None
        if timing:
            self._started = self._clock()

    def time_step(self, rows: int, drafts: int) -> None:
        """This step's rows all decode (``rows`` requests, ``drafts`` drafts among them): :meth:`end_step`
        gives its cost to the K policy."""
        self._timed = (rows, drafts)

    def end_step(self) -> None:
        """An engine step ended: a timed one's cost goes to the K policy; a run of plain steps gives their mean
        once it is complete, and ends unsampled at a step that is not one like the others (drafts, a prompt's
        chunk, another batch size)."""
        timed, run = self._timed, self._run
        if self._started is not None:
            if timed is not None:
                self.policy.step_cost(*timed, self._clock() - self._started)
            self._started = self._timed = None
        elif run is not None:
            if timed is None or timed[1] or (run.steps and timed[0] != run.rows):
                self._run = None
                return
            run.rows, run.steps = timed[0], run.steps + 1
            if run.steps == run.length:
                self.policy.step_cost(run.rows, 0, (self._clock() - run.started) / run.steps)
                self._run = None

    def verify(self, sampling: list["Sequence"], sample_logits: torch.Tensor, verify_logits: torch.Tensor,
               state: "SamplingState", sampler: "Sampler", masks: torch.Tensor | None = None) -> list[Emitted]:
        """:meth:`launch_verify` and :meth:`read` at once: every request's rows verified, the result read."""
        return self.read(self.launch_verify(sampling, sample_logits, verify_logits, state, sampler, masks), sampling)

    def launch_verify(self, sampling: list["Sequence"], sample_logits: torch.Tensor, verify_logits: torch.Tensor,
                      state: "SamplingState", sampler: "Sampler", masks: torch.Tensor | None = None,
                      shift: torch.Tensor | None = None) -> Verification:
        """Sample every request's rows at every depth in one pass on the device, and count there how many drafts
        each request accepted; nothing waits for the device (:meth:`read` reads the draws one step later).

        ``sample_logits``: one row per sampling request (its last row); ``verify_logits``: the draft rows'
        logits (``num_drafts`` rows before the last, per request in the same order). ``masks``: the grammar
        bitmask of every row of ``sample_logits`` then ``verify_logits`` (the mask of that position's state,
        :meth:`~..structured_output.StructuredOutputs.bitmask` with the drafts). ``shift``: each row of
        ``sample_logits`` then ``verify_logits`` moved back by the runner (the verify step before was still in
        flight when this one was planned), by which its position and generated count move back too.

        Depth ``j`` is drawn as if the drafts before it were accepted (its position's seeded stream, the
        penalties counting those drafts, the grammar's mask after them); it is only used when they were, and
        then it is exactly what a draw after them is. So one sampler pass and one read serve every depth
        (they were a pass and a read per depth: ``1 + K`` device round trips a step), and only the tokens
        emitted are counted for the penalties afterwards. The accepted count is the first depth whose draw
        differs from its draft (the last depth has none), computed on the device so that the next step can be
        corrected by it before the host reads this one.
        """
        owner: list[int] = []  # the row's request (index into ``sampling``) and depth
        depth_of: list[int] = []
        logit_rows: list[int] = []  # its logits' row: the j-th draft row, or the request's sampling row
        guesses = [s.token_ids[len(s.token_ids) - s.num_drafts:] if s.num_drafts else [] for s in sampling]
        offset = len(sampling)
        for i, sequence in enumerate(sampling):
            drafts = sequence.num_drafts
            owner.extend([i] * (drafts + 1))
            depth_of.extend(range(drafts + 1))
            logit_rows.extend([*range(offset, offset + drafts), i])
            offset += drafts
        rows = state.rows([sampling[i].request_id for i in owner],
                          [sampling[i].num_computed - sampling[i].num_drafts + j for i, j in zip(owner, depth_of)],
                          [sampling[i].num_generated + j for i, j in zip(owner, depth_of)])
        if offset == len(sampling):  # no drafts at all (the proposer found none): the rows as they are, no copy
            model_logits, index = sample_logits, None
        else:
            index = on_device(logit_rows, torch.int64, sample_logits.device)
            model_logits = torch.cat([sample_logits, verify_logits])[index]
        if shift is not None:
            rows.shift(shift if index is None else shift[index])
        processed = apply_controls(model_logits, state, rows, self._draft_counts(guesses, owner, depth_of, rows, state))
        if masks is not None:
            processed = apply_token_bitmask(processed, masks if index is None else masks[logit_rows])  # on the host
        sample = sampler.launch(processed, rows, None if processed is model_logits else model_logits, count=False)
        accepted, used = self._accepted(sample.tokens, guesses, owner, depth_of)
        if rows.any_penalties:  # the penalties' counts: the tokens emitted, not the depths after a rejection
            state.add_counts(rows, sample.tokens, used.to(torch.float32))
        for drafted in guesses:  # counted as launched (their acceptance as read): a refit between them finds it so
            self.stats.speculated(len(drafted), 0)
        counts = on_device([len(d) for d in guesses], torch.int64, accepted.device)
        return Verification(sample, guesses, counts - accepted)

    @staticmethod
    def _accepted(tokens: torch.Tensor, guesses: list[list[int]], owner: list[int], depth_of: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """On the device: each request's accepted drafts (the first depth whose draw is not its draft) and
        whether each row's draw is emitted (its depth is at most that). A stop token drawn as a draft ends the
        request on the host, which then drops its later rows, so it needs no care here."""
        device = tokens.device
        expected = [guesses[i][j] if j < len(guesses[i]) else -1 for i, j in zip(owner, depth_of)]
        owners, depths, drafts = on_device([owner, depth_of, expected], torch.int64, device)
        rejected = torch.where(tokens != drafts, depths, len(owner))  # a request's last depth has no draft: rejected
        first = torch.full((len(guesses),), len(owner), dtype=torch.int64, device=device)
        accepted = first.scatter_reduce(0, owners, rejected, "amin")
        return accepted, depths <= accepted[owners]

    def read(self, verification: Verification, sampling: list["Sequence"]) -> list[Emitted]:
        """Read a launched verify step's draws (waits for the device) and keep each request's longest accepted
        prefix plus one token; a request that left meanwhile gets nothing (its rows are dropped)."""
        result = verification.sample.read()
        emitted = [Emitted() for _ in sampling]
        row = 0
        for sequence, out, drafted in zip(sampling, emitted, verification.drafts):
            drafts = len(drafted)
            for depth in range(drafts + 1 if not sequence.finished else 0):
                token = result.token_ids[row + depth]
                out.tokens.append(token)
                out.log_probs.append(result.log_probs[row + depth])
                out.top_ids.append(result.top_ids[row + depth])
                out.top_log_probs.append(result.top_log_probs[row + depth])
                out.kept_ids.append(result.kept_ids[row + depth])
                if depth == drafts or token != drafted[depth] or token in sequence.stop_token_ids:
                    break
                out.accepted += 1
            row += drafts + 1
            if drafts and not sequence.finished:
                self.stats.accepted_drafts(out.accepted)
                self.policy.verified(sequence.request_id, drafts, out.accepted)
        return emitted

    @staticmethod
    def _draft_counts(guesses: list[list[int]], owner: list[int], depth_of: list[int], rows: "StepRows",
                      state: "SamplingState") -> torch.Tensor | None:
        """``[rows, vocab]``: the drafts before each row's depth (``guesses``: each request's drafts), which its
        penalties count on top of the request's output so far (None when no row has penalties or no row is past
        depth 0)."""
        if not rows.any_penalties or not any(depth_of):
            return None
        vocab = state.vocab_size
        flat = [row * vocab + token for row, (i, j) in enumerate(zip(owner, depth_of)) if j
                for token in guesses[i][:j] if token < vocab]
        counts = torch.zeros(len(owner) * vocab, dtype=torch.float32, device=rows.control.device)
        counts.index_add_(0, on_device(flat, torch.int64, counts.device),
                          torch.ones(len(flat), dtype=torch.float32, device=counts.device))
        return counts.view(len(owner), vocab)

    def forget(self, request_id: str) -> None:
        """The request left the engine: the proposer's state and the policy's estimate of it go (and a rest ends:
        the rows changed)."""
        self.wake()
        self.proposer.forget(request_id)
        self.policy.forget(request_id)
