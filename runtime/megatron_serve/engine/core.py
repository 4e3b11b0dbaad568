"""``DynamicInferenceEngine``: one model replica, its paged KV cache, and the step loop over requests.

The engine is the loop over three kinds of object: the scheduler (:mod:`.scheduler`: which requests run, and
what a finished step did to them), the worker (:mod:`.worker`: the device half, its runner, sampler, sampling
state, grammar masks and image embeddings) and the verbs' objects (``memory``: suspend, resume, refit;
``adapters``: LoRA), with ``speculator`` the K policy and drafter (speculative decoding on). A step is three calls with
one job each: ``schedule()`` picks what runs, the worker's ``launch()`` writes the plan into the persistent step
buffers, runs the forward and samples on the device without waiting for it, and ``_finish()`` reads the sampled
tokens back (the worker) and updates the requests (the scheduler). With ``async_scheduling`` (the default),
``step()`` schedules and launches step N+1 before it finishes step N, so on a GPU the host's work for the next
step (scheduling, the plan, kernel launches, reading results, building outputs) overlaps the device's work on the
current one; a request's next input token then stays on the device (the plan gathers it there) and the host reads
it one step later. A grammar row's mask needs its previous token on the host: a step with such a row launches its
forward, then finishes the step before it (the one sync point, taken only by steps with a grammar row, while the
new forward runs), fills the masks and samples (vLLM's split of ``execute_model`` and ``sample_tokens`` under
async scheduling). Stop conditions are seen one step late, so a finished request may have computed one more row,
which is dropped: the outputs are those of the serial loop, token for token. Speculative verify steps overlap
too: the step after one is planned as if it accepted every draft and corrected on the device by the drafts it
rejected (:mod:`.speculative.decoder`; the cases that read first instead are listed in
:meth:`~.speculative.decoder.Speculator.overlaps`). Drafts are data: the speculator appends a request's drafts to its
tokens before the step is scheduled (``num_drafts``), the scheduler gives them query rows, the worker verifies a step
that has draft rows, and the scheduler rolls the rejected ones back by counts when the step is read (:mod:`.drafts`).

The engine process reaches every lifecycle verb through one entry, ``call(step, body)`` (:mod:`.verbs.actions`: one table of
actions over the verbs' objects), and prefill/decode disaggregation through two, ``kv_in`` and ``kv_out``.

The engine never raises for a bad request: the request fails alone and comes back from ``step()``.
It deals in token ids only: EOS, stop token ids, length and grammar completion end a request here;
text and stop strings are made by whoever reads the tokens (:mod:`megatron_serve.client.output_processor`),
off the step thread.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import InferenceConfig
from ..model.config import ModelConfig
from ..model.llama import LlamaForCausalLM
from ..model.loader import load_model
from ..tokenizer import Tokenizer, TokenizerFiles, Vocabulary
from ..wire.engine_stats import EngineStats
from ..wire.kv_blocks import KVBlocks, wants_remote_decode, wants_remote_prefill
from ..wire.lifecycle import Step
from .admission import Admission
from .expert_api import Ended, ExpertApi, Submitted
from .experts.backend import install_expert_backend
from .precompile.graphs import graphs_for, largest_graph
from .kv.tiers import KVTiers
from .sampling.logprob_parity import ParityChecker
from .lora.adapters import engine_loras
from .lora.verbs import Adapters
from .verbs.memory import DeviceMemory
from .report import EngineReport
from .runner import ModelRunner
from .sampling.sampler import Sampler
from .scheduler import ScheduledBatch, Scheduler
from .served import EngineFacts, EngineLoad, Serving, Turn
from .sizing import build_kv_pool, default_dtype, engine_buffers, max_sequence_length_for
from .speculative.factory import make_speculator
from .steps import InFlightStep, StepOutput, one_per_request
from .verbs.actions import call
from .worker import ModelWorker
from ..weights.peer_pull import layout_digest

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class DynamicInferenceEngine:
    """The step loop over the scheduler (the bookkeeping), the worker (the device half: runner, sampler, sampling
    state, grammar masks, image embeddings) and the verbs' objects: ``memory`` (suspend, resume, refit) and
    ``adapters`` (LoRA), with ``speculator`` (the K policy and the drafter, with speculative decoding on), behind
    :class:`~.served.ServedEngine`."""

    def __init__(self, model: LlamaForCausalLM, tokenizer: Vocabulary, config: InferenceConfig,
                 runner: ModelRunner | None = None, model_dir: str | Path | None = None):
        """``model_dir``: where the model came from, when known (a draft model of another vocabulary is refused)."""
        install_expert_backend(model, config)  # expert parallelism's all-to-all (--all2all-backend)
        if config.batch_invariant:
            model.use_batch_invariant_ops()
        if (seam := config.trainer_seam_warning()) is not None:
            logger.warning(seam)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.device = next(model.parameters()).device
        self.max_sequence_length = max_sequence_length_for(model.config, config)
        pool = build_kv_pool(model, config, self.max_sequence_length, self.device, largest_graph(config, self.device))
        block_size = config.block_size_tokens
        if runner is None:
            buffers = engine_buffers(config, self.max_sequence_length, self.device)
            runner = ModelRunner(model, block_size, self.device, buffers, graphs_for(model, config, buffers))
        self.kv = kv = KVTiers(pool, config, runner.kv_copier(), runner.kv_others())
        # the parts the scheduler, the worker and the verbs' objects are built from
        self.kv_cache, self.allocator, self.host_tier, self.kv_events = pool, kv.allocator, kv.host_tier, kv.events
        self._in_flight: InFlightStep | None = None  # launched, not finished (overlapped scheduling)
        self.stats = EngineStats()  # vLLM-style counters and histograms, shipped in heartbeats
        self.parity = ParityChecker(config.verify_logprobs_fraction, self.max_sequence_length, config.logprobs_mode,
                                    Sampler.processed_alone)
        self.speculator = make_speculator(config, model, self.stats, model_dir)
        self.worker = ModelWorker(model, tokenizer, config, runner, self.kv_cache, self.parity, self.speculator)
        self.loras = engine_loras(model, config, runner, self.kv_cache.layer_caches)  # after the base graphs
        admission = Admission(model.config, self.max_sequence_length, block_size, self.allocator.num_blocks,
                              tuple(tokenizer.eos_token_ids), config.seed, self.worker.encoder_cache, self.loras,
                              self.worker.structured)
        self.scheduler = Scheduler(self.allocator, block_size, config.max_batch_tokens, config.max_requests,
                                   config.long_prefill_token_threshold, config.max_long_partial_prefills,
                                   admission=admission, stats=self.stats, parity=self.parity,
                                   scheduling_policy=config.scheduling_policy)
        # Nothing the engine holds refers back to it (a cycle kept a dropped engine and its KV pool alive until a
        # later garbage collection): the hooks close over its parts, the verbs reach settle() through a weak reference.
        kv.serve(self.scheduler, model_dir, lambda: layout_digest(model))
        self.scheduler.forgets.append(self.worker.forget)
        self.expert = ExpertApi()  # the public requests added (Megatron's expert API), applied their outputs
        self.scheduler.emitted.append(self.expert.apply)
        settle = weakref.WeakMethod(self.settle)
        self.memory = DeviceMemory(model, config, self.worker, self.kv_cache, self.scheduler, self.parity,
                                   self.speculator, self.loras, lambda: settle()())
        self.adapters = Adapters(self.loras, self.stats)
        self.serving = Serving(lora_push_dir=config.lora_push_dir)  # what the verbs leave (.verbs)
        self.report = EngineReport(model, config, self.max_sequence_length, kv, self.scheduler, self.worker,
                                   self.stats, self.loras)

    @property
    def epoch(self) -> int:
        """Generation of the weights being served, bumped by every refit (-1: a mix after a failed one); the
        scheduler's, which keys the prefix cache and the tokens' epochs with it."""
        return self.scheduler.epoch

    def load(self) -> EngineLoad:
        return self.report.load()  # (:class:`~.served.ServedEngine`'s three reports: :mod:`.report`)

    def metrics_snapshot(self) -> dict:
        return self.report.metrics()

    def facts(self) -> EngineFacts:
        return self.report.facts()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: InferenceConfig | None = None,
                       tokenizer_dir: str | Path | None = None, vocabulary_only: bool = False
                       ) -> "DynamicInferenceEngine":
        """Load model and tokenizer (from ``tokenizer_dir`` when given, else ``model_dir``); with
        ``tensor_parallel_size > 1`` also start and join the other ranks. ``vocabulary_only``: the engine's own
        :class:`~megatron_serve.tokenizer.Vocabulary`, without ``transformers`` (an engine process, which makes no
        text), instead of the whole tokenizer that the caller's process makes text with."""
        config = config or InferenceConfig()
        model_config = ModelConfig.from_dir(model_dir)
        files = tokenizer_dir or model_dir
        tokenizer = TokenizerFiles.from_dir(files) if vocabulary_only else Tokenizer.from_pretrained(files)
        dtype = default_dtype(config, model_config)
        if config.world_size == 1:
            return cls(load_model(model_dir, dtype, config.device, quantization=config.quantization), tokenizer, config,
                       model_dir=model_dir)
        return _group_leader(cls, model_dir, config, tokenizer, dtype, model_config)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any, and the KV events' publisher; the engine is unusable
        afterwards."""
        self.worker.runner.shutdown()
        self.kv.close()

    # ------------------------------------------------------------ requests in and out
    def has_unfinished_requests(self) -> bool:
        """Outputs to hand out, requests to run, or a step in flight that still samples for a live request
        (one whose requests were all aborted meanwhile has nothing left to give: the next step drops it)."""
        in_flight = self._in_flight is not None and not all(s.finished for s in self._in_flight.sampling)
        scheduler = self.scheduler
        return bool(scheduler.pending) or in_flight or scheduler.has_work() or bool(scheduler.lora_queue)

    def group_turn(self, busy: bool, holding: bool = False) -> Turn:
        """Whether the step loop steps now, given whether this engine has work, and acts on the verb it holds: with
        data-parallel attention, while any rank of the group has work, and once every rank holds its copy of the
        verb (:mod:`.group.data_parallel`)."""
        return self.worker.runner.group_turn(busy, holding)

    def call(self, step: Step | str, body: Any) -> dict[str, Any]:
        """A lifecycle verb (or a registration) between two steps, given its message: what the engine did, the
        acknowledgement's detail (one table of actions, :mod:`.verbs.actions`)."""
        return call(self, step, body)

    def add_request(self, request: Submitted, kv_transfer_params: dict[str, Any] | None = None) -> None:
        """Queue a request: an ``EngineRequest``, or a public request that the engine's outputs are applied to as
        they are made (Megatron's expert API, :mod:`.expert_api`); one that can never run fails alone (reported
        by the next ``step``). ``kv_transfer_params`` (vLLM's, :mod:`.kv.transfer`): its KV goes on to a decode
        engine after its first token (``do_remote_decode``), or it starts on the blocks a prefill engine computed,
        which arrived first (``do_remote_prefill``, :meth:`kv_in`); parts of any other request are dropped."""
        request_id = request.request_id
        if wants_remote_decode(kv_transfer_params):
            self.kv.transfer.send_after_prefill(request_id)
        self.expert.add(request, self.scheduler.add_request)
        if not wants_remote_prefill(kv_transfer_params):
            self.kv.transfer.discard(request_id)
        elif (sequence := self.scheduler.requests.get(request_id)) is not None:
            self.kv.transfer.receive(sequence, self.epoch, self.scheduler.waiting)

    def kv_in(self, part: KVBlocks) -> None:
        """A part of a prefilled request's KV blocks (``KV_BLOCKS``), ahead of the request, which starts on them."""
        self.kv.transfer.arrive(part)

    def kv_out(self, engine_id: str) -> list[KVBlocks]:
        """The blocks of requests prefilled here that go on to a decode engine, copied out since the last call, as
        the ``KV_BLOCKS`` parts of registration ``engine_id``."""
        return self.kv.transfer.take(engine_id)

    def abort_request(self, request_id: str) -> Ended | None:
        """Drop a request; its final record (the public request, for one added so), or None if unknown."""
        sequence = self.scheduler.abort_request(request_id)
        return None if sequence is None else self.expert.ended(sequence)

    def take_unfinished_requests(self, forget_transfers: bool = False) -> list[Ended]:
        """Hand back every unfinished request (draining), as its final record (the public request, for one added
        so): blocks freed, tokens generated so far kept. ``forget_transfers`` (a new registration, whose coordinator
        sends its requests again): every KV part that arrived and every mark of blocks to send is dropped first.

        The step in flight is finished first: its tokens are on the public requests handed back (a caller that
        must deliver them as outputs calls ``sync()`` first); outputs of requests it finished stay for ``step()``.
        After a failed step (the caller fails what it hands back), a step in flight that fails too is dropped.
        """
        if forget_transfers:
            self.kv.transfer.clear()
        try:
            self.settle()
        except Exception:  # noqa: BLE001 - the failure that brought us here is being handled
            logger.exception("finishing the step in flight failed; its tokens are dropped")
        sequences = self.scheduler.take_unfinished()
        request_ids = [s.request_id for s in sequences]
        self.worker.clear(request_ids)  # the requests leave: their device state too
        self.kv.release(request_ids)  # and the slots held for those waiting for disk reads
        return [self.expert.ended(s) for s in sequences]

    # ------------------------------------------------------------------ step
    def step(self) -> list[StepOutput]:
        """Run one step: schedule, launch, finish. With ``async_scheduling`` the step finished is the one launched by
        the previous call, after this call launched the next (its outputs come one call later), but a step in which a
        better class displaced a worse one is read at once (``ScheduledBatch.displacing`` says why). With speculation
        on, the K policy first puts each decode-ready request's drafts in the step
        (:meth:`~.speculative.decoder.Speculator.begin`): a verify step, overlapped too unless it must be read at once.
        """
        speculator, scheduler = self.speculator, self.scheduler
        ks, at_once = (None, False) if speculator is None else speculator.begin(scheduler.running, scheduler.waiting,
                                                                                self.worker.structured)
        outputs = self._launch_and_read(ks, at_once)
        if speculator is not None and ks is not None:
            speculator.end_step()
        self.worker.runner.end_step()  # data-parallel attention: a rank that ran no forward joins the MoE layers empty
        self.kv_events.flush()  # the step's KV events, one batch
        return self.parity.deliver(outputs, self.epoch, self.stats, self.scheduler.add_request)

    def idle(self) -> None:
        """A turn of the process loop with nothing to step: the disk tier's writes that landed since still reach
        the KV events (a step flushes them; an idle engine would keep them until its next request)."""
        self.kv.idle()

    def _launch_and_read(self, ks: dict[str, int] | None, at_once: bool) -> list[StepOutput]:
        """One step, launched before the one in flight is read (see :meth:`step`): a plain step, or with ``ks`` (each
        drafting request's K) a verify step, whose drafts are proposed before it is scheduled and cut to the rows it
        got. ``at_once``: a verify step that cannot overlap, launched after the step in flight is read and read at
        once (the tokens of both in one output per request)."""
        scheduler, speculator = self.scheduler, self.speculator
        if at_once:
            self.settle()
        outputs = scheduler.take_pending()
        if ks and speculator is not None:
            speculator.propose(scheduler.running, ks, self.worker.structured.draft_prefix)
        batch = self.schedule()
        if ks and speculator is not None:
            speculator.fit(batch, scheduler.running, [s for s in scheduler.waiting if s.num_drafts])
        launched = (self.worker.launch(batch, self._in_flight, self.epoch, scheduler.fail, at_once) if batch is not None
                    else None)
        previous, self._in_flight = self._in_flight, None
        if speculator is not None and launched is not None:
            speculator.launched(batch, launched, previous, bool(ks))
        if launched is not None and launched.sample is None and launched.emitted is None:
            # Its grammar rows need the tokens the previous step samples: finish that one first (the forward
            # just launched runs meanwhile), then fill the masks and sample.
            if previous is not None:
                outputs += self._finish(previous)
                previous = None
            self.worker.sample(launched)
        done = [previous] if previous is not None else []
        displacing = batch is not None and batch.displacing  # read now: both steps' tokens, one output per request
        if self.config.async_scheduling and not at_once and not displacing:
            self._in_flight = launched
        elif launched is not None:
            done.append(launched)
        for step in done:
            outputs += self._finish(step)
        outputs += scheduler.take_pending()
        return one_per_request(outputs) if at_once or displacing else outputs

    def sync(self) -> list[StepOutput]:
        """Finish the step in flight, if any, and return every output not handed out yet (call before a
        lifecycle verb or a hand-back, so that tokens the device already sampled are delivered first)."""
        self.settle()
        return self.parity.deliver(self.scheduler.take_pending(), self.epoch, self.stats, self.scheduler.add_request)

    def settle(self) -> None:
        """Finish the step in flight now; its outputs wait for the next ``step()`` or ``sync()``."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            self.scheduler.pending.extend(self._finish(in_flight))

    def schedule(self) -> ScheduledBatch | None:
        """What the next step computes, or None when nothing can run now."""
        scheduler = self.scheduler
        scheduler.lora_queue.release(scheduler, scheduler.requests.values())
        if self.memory.suspended or not scheduler.has_work():
            return None
        batch = scheduler.schedule()
        if not batch and self._in_flight is None:
            self.kv.wait_for_disk()  # only requests whose blocks are on their way: no spin
        self.stats.preempted(len(batch.preempted))
        for sequence in batch.preempted:  # bound again, from its tokens, when it samples next
            self.worker.unbind(sequence.request_id)
        return batch or None

    def _finish(self, step: InFlightStep) -> list[StepOutput]:
        """Read a launched step's results (waits for the device) and hand each request its tokens."""
        return self.scheduler.update_from_output(step, self.worker.read(step))


def _group_leader(cls: type[DynamicInferenceEngine], model_dir: str | Path, config: InferenceConfig,
                  tokenizer: Vocabulary, dtype: torch.dtype, model_config: ModelConfig) -> DynamicInferenceEngine:
    """The engine at rank zero of a tensor-parallel group (:meth:`DynamicInferenceEngine.from_model_dir`): the other
    ranks are started and joined first, and abandoned when the model or the engine fails to load."""
    from .group.leader import TensorParallelRunner  # noqa: PLC0415
    from .group.spawn import abandon_group, start_rank_zero  # noqa: PLC0415
    from .group.survival import GroupSurvival  # noqa: PLC0415

    tp, channel, device, workers = start_rank_zero(str(model_dir), config)
    try:
        model = load_model(model_dir, dtype, device, tp, quantization=config.quantization)
        buffers = engine_buffers(config, max_sequence_length_for(model_config, config), device)
        survival = GroupSurvival(model, channel, model_dir, config) if config.elastic_expert_group else None
        runner = TensorParallelRunner(model, config.block_size_tokens, device, buffers, channel, workers,
                                      graphs_for(model, config, buffers), survival)
        return cls(model, tokenizer, config, runner, model_dir)
    except BaseException:
        abandon_group(workers)
        raise
