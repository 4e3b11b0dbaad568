"""``ModelWorker``: the device half of a step, as one object (vLLM's ``GPUModelRunner`` at this engine's size).

It owns what lives on the device or feeds it: the runner (the model's forward over the paged KV pool, graphs
and tensor-parallel ranks included), the sampler and the per-request sampling state, the grammar masks
(:mod:`.structured_output`) and the image embeddings (:mod:`.encoder_cache`). The step loop hands it a
scheduled batch and gets back a launched step (:meth:`ModelWorker.launch`), then reads it
(:meth:`ModelWorker.read`); the bookkeeping of what the tokens do to the requests is the scheduler's. The
device-memory verbs reach the runner through the worker, so that a runner swapped in (a test's graphs) is the one
they release and capture.

Speculation plugs in as the worker's verify hook (:class:`VerifyHook`, which the speculator is): a step with draft
rows is verified on the device by the hook instead of sampled, and read by it; the rejected drafts are rolled back
by the scheduler when the step is read. A worker without a hook never looks at drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch

from ..heap import keep_freed_memory
from .encoder_cache import EncoderCache
from .sampling.logits_processors import apply_controls, apply_token_bitmask
from .sampling.prompt_scores import score_prompts
from .sampling.sampler import Readback, Sampler
from .sampling.sampling_state import SamplingState
from .step_plan import write_plan
from .drafts import mark_in_flight
from .steps import Emitted, InFlightStep, Verification
from .sampling.structured_output import StructuredOutputs

if TYPE_CHECKING:
    from ..config import InferenceConfig
    from ..model.llama import LlamaForCausalLM
    from ..tokenizer import Vocabulary
    from .kv.cache import KVCachePool
    from .sampling.logprob_parity import ParityChecker
    from .runner import ModelRunner
    from .scheduler import ScheduledBatch
    from .sequence import Sequence


def encoder_cache_for(model: LlamaForCausalLM, tokenizer: Vocabulary) -> EncoderCache | None:
    """The image side of a vision-language model (None for a text model)."""
    if model.config.vision is None:
        return None
    if tokenizer.images is None:
        raise ValueError(f"{model.config.architecture} needs its image processor: the tokenizer was loaded "
                         "without one (load it from the model directory)")
    return EncoderCache(model, tokenizer.images)


class VerifyHook(Protocol):
    """What the worker asks of speculative decoding: a step with draft rows verified on the device (at once, or
    launched and read one step later) instead of sampled, and a request's drafting state dropped when it leaves."""

    def verify(self, sampling: list[Sequence], sample_logits: torch.Tensor, verify_logits: torch.Tensor,
               state: SamplingState, sampler: Sampler, masks: torch.Tensor | None = None) -> list[Emitted]: ...

    def launch_verify(self, sampling: list[Sequence], sample_logits: torch.Tensor, verify_logits: torch.Tensor,
                      state: SamplingState, sampler: Sampler, masks: torch.Tensor | None = None,
                      shift: torch.Tensor | None = None) -> Verification: ...

    def read(self, verification: Verification, sampling: list[Sequence]) -> list[Emitted]: ...

    def forget(self, request_id: str) -> None: ...


class ModelWorker:
    """Launches, samples and reads steps over one model replica's runner and KV pool. ``parity``: the engine's
    log-prob checks (their prompt rows are scored as their originals were processed); ``speculator``: the verify
    hook, with speculation on. Nothing it holds refers back to the engine."""

    def __init__(self, model: LlamaForCausalLM, tokenizer: Vocabulary, config: InferenceConfig, runner: ModelRunner,
                 kv_cache: KVCachePool, parity: ParityChecker, speculator: VerifyHook | None):
        self.config = config
        self.kv_cache = kv_cache
        self.runner = runner
        runner.compile_kernels(kv_cache.layer_caches)
        runner.capture_graphs(kv_cache.layer_caches)
        device = next(model.parameters()).device
        if device.type == "cpu":  # a step's buffers stay in the heap from step to step (see keep_freed_memory)
            keep_freed_memory()
        self.sampling_state = SamplingState(model.config.vocab_size, device, config.max_requests)
        self.sampler = Sampler(self.sampling_state, config.logprobs_mode)
        self.structured = StructuredOutputs(tokenizer, model.config.vocab_size, device.type == "cuda")
        self.structured.warm()  # llguidance loaded off the step: the first constrained request stopped it for seconds
        self.encoder_cache = encoder_cache_for(model, tokenizer)
        self.parity = parity
        self.speculator = speculator
        self.computed_tokens = 0  # tokens run through the model (prefill and decode), for counters

    def launch(self, batch: ScheduledBatch, previous: InFlightStep | None, epoch: int,
               fail: Callable[[Sequence, str], None], verify_at_once: bool = False) -> InFlightStep | None:
        """Write the plan, run the forward and sample on the device; nothing waits for the device here, except
        with ``verify_at_once`` (a verify step not overlapped), whose drafts are verified and read right away.
        ``previous``: the step in flight, whose sampled tokens (and, after a verify step, whose rejected drafts)
        the plan gathers on the device; ``epoch``: the weights' generation new KV is computed under; ``fail``: how a
        request whose images cannot be encoded leaves (the scheduler's).

        A step with a grammar row whose previous token is still in flight is returned unsampled: the step loop
        samples it once that token is on the host.
        """
        entries, images = batch.entries, None
        if self.encoder_cache is not None:
            images, entries, failed = self.encoder_cache.prepare(entries)
            for sequence, message in failed:
                fail(sequence, message)
            if not entries:
                return None
        plan = write_plan(entries, self.config.block_size_tokens, self.runner.buffers, images)
        gathered = previous.sample.tokens if plan.num_gather else None  # write_plan gathers only after a step in flight
        shifts = previous.verification.shifts if plan.shifted else None  # write_plan set it: a verify step flies
        forward = self.runner.run_plan(plan, self.kv_cache.layer_caches,
                                       None if images is None else images.embeddings, gathered, shifts)
        sampling = [s for s, count in entries if count == s.num_uncomputed]  # as write_plan picked them
        starts = [s.num_computed for s, _ in entries]
        scores = score_prompts(entries, forward.logits[len(sampling) : len(sampling) + plan.num_score],
                               self.parity.score_view)
        for sequence, count in entries:
            if sequence.kv_epoch is None:
                sequence.kv_epoch = epoch
            sequence.num_computed += count
        self.computed_tokens += plan.num_tokens
        routing = Readback([forward.routing]) if forward.routing is not None else None  # graphs reuse their outputs
        kv_epochs = [epoch if s.kv_epoch is None else s.kv_epoch for s in sampling]  # set above: never None
        step = InFlightStep(entries, starts, sampling, kv_epochs, forward.logits[: len(sampling)], scores, routing,
                            [s.num_computed for s in sampling], [s.num_generated for s in sampling], forward.shift)
        if plan.num_verify:  # verified in sample(), rows with drafts or not (rows of one step are sampled alike)
            step.verify_logits = forward.logits[len(sampling) + plan.num_score :]
        if not any(s.pending_tokens and s.request_id in self.structured for s in sampling):
            self.sample(step, verify_at_once)
        return step

    def sample(self, step: InFlightStep, verify_at_once: bool = False) -> None:
        """Apply the logits controls and grammar masks to a launched step's logits and sample on the device (a
        verify step: verify its drafts, the speculator's hook).

        Each request is bound to its sampling-state slot the first time it samples; after that a step
        only writes the rows' slots and counters (``SamplingState.rows``). A verify step's draws are read in
        :meth:`read`, or here with ``verify_at_once``.
        """
        state, sampling = self.sampling_state, step.sampling
        for s in sampling:
            if s.request_id not in state and not s.finished:
                state.add(s.request_id, s.sampling_params, s.seed, s.prompt_tokens, s.output_tokens,
                          s.stop_token_ids)
        drafts = ([s.token_ids[len(s.token_ids) - s.num_drafts:] for s in sampling]
                  if step.verify_logits is not None else None)  # a verify step: a mask per verified position
        masks = self.structured.bitmask([s.request_id for s in sampling], [s.stop_token_ids for s in sampling], drafts)
        if step.verify_logits is not None and self.speculator is not None:
            self._verify(step, masks, verify_at_once)
            return
        logits, shift = step.logits, step.shift
        rows = state.rows([s.request_id for s in sampling], step.positions, step.generated)
        if shift is not None:
            rows.shift(shift[: len(sampling)])
        processed = apply_controls(logits, state, rows)
        if masks is not None:  # filled on the host while the forward runs
            processed = apply_token_bitmask(processed, masks)
        step.sample = self.sampler.launch(processed, rows, model_logits=None if processed is logits else logits)
        step.logits = None
        for row, sequence in enumerate(sampling):
            sequence.pending_tokens += 1
            sequence.pending_row = row
            sequence.verify_row = -1

    def _verify(self, step: InFlightStep, masks: torch.Tensor | None, verify_at_once: bool) -> None:
        """The verify hook: every row of a step with drafts drawn at every depth by the speculator, read at once
        with ``verify_at_once``, else left on the device for :meth:`read`."""
        speculator, sampling, shift = self.speculator, step.sampling, step.shift
        assert speculator is not None and step.logits is not None and step.verify_logits is not None
        step.drafts = [s.num_drafts for s in sampling]
        if verify_at_once:
            step.emitted = speculator.verify(sampling, step.logits, step.verify_logits, self.sampling_state,
                                             self.sampler, masks)
        else:
            if shift is not None:  # the sampling rows' then the draft rows' (the score rows between do not draw)
                shift = torch.cat([shift[: len(sampling)], shift[len(shift) - len(step.verify_logits):]])
            step.verification = speculator.launch_verify(sampling, step.logits, step.verify_logits,
                                                         self.sampling_state, self.sampler, masks, shift)
            step.sample = step.verification.sample
        step.logits = step.verify_logits = None
        mark_in_flight(sampling, step.drafts)

    def read(self, step: InFlightStep) -> list[Emitted]:
        """A launched step's tokens per sampling row (waits for the device), for the scheduler's
        ``update_from_output``."""
        if step.emitted is not None:
            return step.emitted
        if step.verification is not None and self.speculator is not None:
            return self.speculator.read(step.verification, step.sampling)
        assert step.sample is not None, "read() of a step that was never sampled"
        result = step.sample.read()
        return [Emitted([t], [lp], [ids], [lps], kept_ids=[kept]) for t, lp, ids, lps, kept in
                zip(result.token_ids, result.log_probs, result.top_ids, result.top_log_probs, result.kept_ids)]

    def unbind(self, request_id: str) -> None:
        """Free a request's sampling-state slot (it was preempted: bound again, from its tokens, when it samples
        next)."""
        self.sampling_state.remove(request_id)

    def forget(self, request_id: str) -> None:
        """Drop what the device side holds for a request that left (its sampling state, drafter state, images)."""
        self.sampling_state.remove(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)
        if self.encoder_cache is not None:
            self.encoder_cache.release(request_id)

    def clear(self, request_ids: list[str]) -> None:
        """Every request was handed back (draining): sampling state and images go at once, and the drafter's state
        of ``request_ids``."""
        self.sampling_state.clear()
        if self.encoder_cache is not None:
            self.encoder_cache.clear()
        if self.speculator is not None:
            for request_id in request_ids:
                self.speculator.forget(request_id)
