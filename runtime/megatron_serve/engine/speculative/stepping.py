"""The engine's verify step: the strategy :class:`~..core.DynamicInferenceEngine` holds when speculation is on.

:meth:`~..core.DynamicInferenceEngine.step` runs a verify step when the K policy gives some request drafts
(:meth:`.decoder.Speculator.plan`), a plain step otherwise. A verify step is overlapped like a plain one
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
    from ..encoder_cache import EncoderCache
    from ..scheduler import ScheduledBatch, Scheduler
    from ..sequence import Sequence
    from ..structured_output import StructuredOutputs
    from .decoder import Speculator


class StepLoop(Protocol):
    """The engine's step seam, as a verify step drives it (the engine itself)."""

    def settle(self) -> None: ...  # finish the step in flight, its outputs kept in the scheduler's ``pending``

    def schedule(self) -> ScheduledBatch | None: ...

    def launch(self, batch: ScheduledBatch, verify_at_once: bool = False) -> InFlightStep | None: ...

    def finish(self, step: InFlightStep) -> list[StepOutput]: ...


class SpeculativeSteps:
    """The verify step over the engine's speculator, scheduler and grammars; the engine's step loop is handed in
    where a verify step drives it."""

    def __init__(self, speculator: Speculator, scheduler: Scheduler, structured: StructuredOutputs,
                 config: InferenceConfig, encoder_cache: EncoderCache | None):
        self.speculator = speculator
        self.scheduler = scheduler
        self.structured = structured
        self.config = config
        self.encoder_cache = encoder_cache

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
                or config.tensor_parallel_size > 1 or self.encoder_cache is not None):
            return False
        structured = self.structured
        return not any(s.request_id in structured or s.routing is not None or s.request.prompt_scores_missing
                       for queue in (self.scheduler.running, self.scheduler.waiting) for s in queue)

    def step_at_once(self, ks: dict[str, int], loop: StepLoop) -> list[StepOutput]:
        """A verify step not overlapped (one of :meth:`overlaps`' fallbacks): the step in flight finished
        first, drafts attached (``ks``: each drafting request's K), scheduled as extra query rows, launched, then
        read, verified and rolled back before the next step is planned."""
        loop.settle()
        batch = self.schedule(ks, loop)
        step = loop.launch(batch, verify_at_once=True) if batch is not None else None
        if step is not None:
            self.speculator.observe(step.entries, step.starts)
            self.scheduler.pending.extend(loop.finish(step))  # launch() verified it: no row waits for a token in flight
        return one_per_request(self.scheduler.take_pending())  # the step in flight's tokens and this one's, one output

    def schedule(self, ks: dict[str, int], loop: StepLoop) -> ScheduledBatch | None:
        """Propose each drafting request's drafts (``ks``: its K), schedule, and drop the drafts that got no row."""
        speculator, scheduler = self.speculator, self.scheduler
        speculator.propose(scheduler.running, ks, self._grammar_allows)
        batch = loop.schedule()
        speculator.fit(batch, scheduler.running, [s for s in scheduler.waiting if s.num_drafts])
        return batch

    def _grammar_allows(self, sequence: Sequence, drafts: list[int]) -> int:
        """How many of ``sequence``'s drafts its grammar accepts in a row (all without a grammar)."""
        return self.structured.draft_prefix(sequence.request_id, drafts, sequence.stop_token_ids)
