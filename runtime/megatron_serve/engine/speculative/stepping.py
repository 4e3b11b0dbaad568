"""The engine's verify step: the strategy :class:`~..core.DynamicInferenceEngine` holds when speculation is on.

:meth:`SpeculativeSteps.step` runs a verify step when the K policy gives some request drafts
(:meth:`.decoder.Speculator.plan`), a plain step otherwise. The worker verifies a verify step's drafts on the
device (its verify hook) and the scheduler rolls the rejected ones back when the step is read: the plain step
pays for none of it. A verify step is overlapped like a plain one
(scheduled and launched before the step in flight is read, drafted past its tokens and corrected on the device:
:mod:`.decoder`) unless one of :meth:`SpeculativeSteps.overlaps`' fallbacks holds; then it reads the step
in flight first and is read at once. A verify step's rows emit one token or several (the accepted drafts and one
more), appended one by one by the scheduler (:mod:`..token_append`) as the plain engine would append them over as
many steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..steps import InFlightStep, StepOutput, one_per_request

if TYPE_CHECKING:
    from ...config import InferenceConfig
    from ..scheduler import ScheduledBatch, Scheduler
    from ..sequence import Sequence
    from ..worker import ModelWorker
    from .decoder import Speculator


class StepLoop(Protocol):
    """The engine's step seam, as the verify step drives it (the engine itself)."""

    def settle(self) -> None: ...  # finish the step in flight, its outputs kept in the scheduler's ``pending``

    def schedule(self) -> ScheduledBatch | None: ...

    def step_overlapped(self, ks: dict[str, int] | None = None) -> list[StepOutput]: ...  # launched before reading


class SpeculativeSteps:
    """The verify step over the engine's speculator, scheduler and worker; the engine's step loop is handed in
    where a verify step drives it. Its hooks: :meth:`step` (the K policy's plan, then a verify or a plain step),
    :meth:`launched` (what the drafter learns of a step launched), the worker's verify and the scheduler's
    rollback of rejected drafts."""

    def __init__(self, speculator: Speculator, scheduler: Scheduler, worker: ModelWorker, config: InferenceConfig):
        self.speculator = speculator
        self.scheduler = scheduler
        self.worker = worker
        self.config = config

    def step(self, loop: StepLoop) -> list[StepOutput]:
        """One engine step with speculation on: the K policy first picks each decode-ready request's drafts
        (:meth:`~.decoder.Speculator.plan`); when some request drafts, the step is a verify step, overlapped too
        unless one of :meth:`overlaps`' fallbacks holds; when none does (or the policy rests), a plain step,
        which costs what a step without speculation costs."""
        speculator, running = self.speculator, self.scheduler.running
        if speculator.resting(len(running)):
            return loop.step_overlapped()
        ks = speculator.plan(running)
        speculator.start_step(bool(ks))
        outputs = self.step_at_once(ks, loop) if ks and not self.overlaps(ks) else loop.step_overlapped(ks)
        speculator.end_step()
        return outputs

    def launched(self, batch: ScheduledBatch | None, launched: InFlightStep, previous: InFlightStep | None,
                 ks: dict[str, int] | None) -> None:
        """A step was launched before the one in flight (``previous``) was read: a proposer that reads the target's
        hidden states files them, and an all-decode plain step after a plain one is timed for the K policy (after
        a verify step it also reads that one)."""
        speculator = self.speculator
        speculator.observe(launched.entries, launched.starts)
        if launched.drafts is not None and previous is not None:
            speculator.overlapped_verify_steps += 1
        elif (not ks and previous is not None and previous.drafts is None and batch is not None
              and batch.num_tokens == len(batch.entries)):
            speculator.time_step(len(batch.entries), 0)

    def overlaps(self, ks: dict[str, int]) -> bool:
        """Whether this verify step (``ks``: each drafting request's K) may be launched before the step in flight is
        read: the fallbacks, in one place. Each is a case where the next step's rows could not be planned without
        the host knowing how many drafts the step in flight accepted, where its drafts would be guessed too blindly,
        or whose correction on the device this engine does not make:

        - a drafting request whose drafts the step in flight verifies: drafted past them, its drafts would assume
          every one kept and the token after them guessed, and each step's drafts would build on the last one's
          assumption, so that once one failed hardly any would be accepted (the figures are in
          ``docs/speculative.md``). Past a plain step's token only that token is guessed (a request's first verify
          step, one after K = 0);
        - no overlapped scheduling (``async_scheduling: false``): nothing is left in flight anyway;
        - a proposer that reads the target's hidden states (MTP, EAGLE-3): it drafts from the rows just read;
        - tensor parallelism: the other ranks would need the correction too;
        - a vision-language model: image rows and multimodal rotary positions are placed on the host;
        - a running or waiting request with a grammar (its masks need its tokens on the host), recording its
          expert routing (recorded per verified position), or asking for prompt log probs (score rows).

        A preemption in the step needs no fallback: the preempted request loses its new drafts, and the step in
        flight's tokens are appended to it when read, its KV recomputed later like any preempted request's.
        """
        speculator, config, sequences = self.speculator, self.config, self.scheduler.requests
        if any(sequences[r].drafts_in_flight for r in ks if r in sequences):
            return False
        if (not config.async_scheduling or speculator.proposer.reads_hidden_states
                or config.tensor_parallel_size > 1 or self.worker.encoder_cache is not None):
            return False
        structured = self.worker.structured
        return not any(s.request_id in structured or s.routing is not None or s.prompt_scores_missing
                       for queue in (self.scheduler.running, self.scheduler.waiting) for s in queue)

    def step_at_once(self, ks: dict[str, int], loop: StepLoop) -> list[StepOutput]:
        """A verify step not overlapped (one of :meth:`overlaps`' fallbacks): the step in flight finished
        first, drafts attached (``ks``: each drafting request's K), scheduled as extra query rows, launched, then
        read, verified and rolled back before the next step is planned."""
        scheduler = self.scheduler
        loop.settle()
        batch = self.schedule(ks, loop)
        step = (self.worker.launch(batch, None, scheduler.epoch, scheduler.fail, verify_at_once=True)
                if batch is not None else None)
        if step is not None:
            self.speculator.observe(step.entries, step.starts)
            # launch() verified it: no row waits for a token in flight
            scheduler.pending.extend(scheduler.update_from_output(step, self.worker.read(step)))
        return one_per_request(scheduler.take_pending())  # the step in flight's tokens and this one's, one output

    def schedule(self, ks: dict[str, int], loop: StepLoop) -> ScheduledBatch | None:
        """Propose each drafting request's drafts (``ks``: its K), schedule, and drop the drafts that got no row."""
        speculator, scheduler = self.speculator, self.scheduler
        speculator.propose(scheduler.running, ks, self._grammar_allows)
        batch = loop.schedule()
        speculator.fit(batch, scheduler.running, [s for s in scheduler.waiting if s.num_drafts])
        return batch

    def _grammar_allows(self, sequence: Sequence, drafts: list[int]) -> int:
        """How many of ``sequence``'s drafts its grammar accepts in a row (all without a grammar)."""
        return self.worker.structured.draft_prefix(sequence.request_id, drafts, sequence.stop_token_ids)
