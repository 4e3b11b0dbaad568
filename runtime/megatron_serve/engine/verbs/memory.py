"""The engine's device-memory verbs as one object the engine holds: suspend and resume (KV pool, weights to host),
refit and its check.

They sit apart from the step loop (:mod:`.core`) because they run between steps, each after the engine's
``settle`` has finished the step in flight, and touch the model and the pools as wholes. Their own state (suspended,
the KV parked in host memory, the refit counters) lives here; the weights' epoch is the scheduler's. A trainer's
refit whose rendezvous carries ``lora`` is an adapter version instead (:meth:`.lora.EngineLoras.push`):
the base weights, their epoch and the prefix cache stay. Any other refit is one transaction over typed targets
(:mod:`.refit_targets`): the policy; the draft model's tensors (``drafter.*``, :mod:`..weights.drafter`) or the
policy's own MTP layers (``model.layers.{num_hidden_layers}.*``, method ``mtp``), loaded under the same epoch right
after the policy's; the LoRA adapter versions a sharded refit may carry (``Rendezvous.adapters``,
:mod:`..weights.adapters`), built before the first policy weight changes. Check all, stream once, commit all or none.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...errors import RefitFailed
from ...weights.peer_pull import PeerWeights
from ...weights.sources import RendezvousSource, WeightSource, weight_source
from ...wire.rendezvous import LoraPush
from ..kv.park import ParkedKV, ParkOrder
from ..lora.adapters import require
from .refit_targets import AdapterTarget, PolicyTarget, WeightTarget, route, speculative_targets

if TYPE_CHECKING:
    from ...config import InferenceConfig
    from ...model.llama import LlamaForCausalLM
    from ..kv.cache import BlockAllocator, KVCachePool
    from ..sampling.logprob_parity import ParityChecker
    from ..lora.adapters import EngineLoras
    from ..scheduler import Scheduler
    from ..speculative.decoder import Speculator
    from ..worker import ModelWorker

logger = logging.getLogger("megatron_serve.engine")


class DeviceMemory:
    """Suspend, resume, refit and its check over the engine's model and pools, reaching the runner and the image
    embeddings through the worker (``settle``: the engine's, finishes the step in flight). The host tier is the
    allocator's."""

    def __init__(self, model: LlamaForCausalLM, config: InferenceConfig, worker: ModelWorker, kv_cache: KVCachePool,
                 scheduler: Scheduler, parity: ParityChecker, speculator: Speculator | None, loras: EngineLoras | None,
                 settle: Callable[[], None]):
        self.model = model
        self.config = config
        self.device = next(model.parameters()).device
        self.worker = worker
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self.allocator: BlockAllocator = scheduler.allocator
        self.parity = parity
        self.speculator = speculator
        self.loras = loras
        self._settle = settle
        self.suspended = False
        self.parked: ParkedKV | None = None  # the KV of live requests while suspended with keep_kv
        self.weights_offloaded = False
        self.refits = 0
        self.last_refit: dict[str, float] | None = None  # timings of the last refit (for /metrics)
        self.incomplete: set[str] = set()  # tensors a failed refit overwrote (see RefitFailed)
        self.peers = PeerWeights(model, followers=worker.runner)  # engines that join later may pull from here

    @property
    def epoch(self) -> int:
        return self.scheduler.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.scheduler.epoch = epoch

    @property
    def kept_kv_bytes(self) -> int:
        """Bytes of the live requests' KV held in host memory while suspended with ``keep_kv`` (0 otherwise)."""
        return self.parked.num_bytes if self.parked is not None else 0

    def suspend(self, level: int = 1, keep_kv: bool = False) -> int:
        """Release the KV pool (and at level 2 move weights to host); returns device bytes released.

        Cached blocks no request holds go to the host tier, if any, before the pool is released. With
        ``keep_kv`` the blocks of the requests in flight are copied to host memory too (:mod:`.kv.park`) and
        ``resume`` copies them back, so that those requests continue without recomputing anything; without
        it they wait to be recomputed from their tokens.
        """
        if level not in (1, 2):
            raise ValueError(f"suspend level must be 1 or 2, got {level}")
        offload = level == 2 and not self.weights_offloaded and self.device.type == "cuda"
        if self.suspended and not offload:
            return 0
        self._settle()
        # Every rank of a group parks the same block ids of its own pool (its stage's layers, its KV heads).
        keep = ParkOrder(self.allocator.blocks_in_use(), self.epoch) if keep_kv and not self.suspended else None
        self.worker.runner.on_suspend(level, keep)
        released = 0
        if not self.suspended:
            if keep is not None:
                self.parked = ParkedKV.park(self.kv_cache, keep.blocks, keep.epoch)
            else:
                self.scheduler.evict_all()
            if self.allocator.tier is not None:
                evictable = self.allocator.evictable_blocks()
                self.allocator.tier.store(evictable, self.allocator.bands_of(evictable))
                self.allocator.tier.wait()
            self.allocator.drop_evictable()  # their contents die with the pool; blocks in use keep theirs (keep_kv)
            if self.worker.encoder_cache is not None:
                self.worker.encoder_cache.clear()  # image embeddings are device memory too
            released += self.kv_cache.release()
            self.suspended = True
        if offload:
            released += sum(p.numel() * p.element_size() for p in self.model.parameters())
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self.weights_offloaded = True
        return released

    def refit(self, source: str | Path | WeightSource, epoch: int | None = None) -> dict[str, Any]:
        """Load new weights of the same shapes in place; returns timings and the new epoch.

        ``source``: a model directory (every weight), or a :mod:`megatron_serve.weights.sources`
        source (tensors in this process, a trainer's broadcast: any subset of the weights). One transaction over
        the refit's targets (:mod:`.refit_targets`): every target checks its names and shapes before any live
        weight is touched, so a bad source leaves the old weights serving; the source streams once; then every
        target commits, or none. Cached prefix blocks of the old weights are forgotten; requests in flight
        keep their KV and continue, and their per-token epochs show the switch.

        A load that fails midway (a read error, a trainer that died) raises
        :class:`~megatron_serve.errors.RefitFailed` saying which weights this engine now holds;
        when some were overwritten the epoch becomes -1 until a refit covers them again.
        """
        source = weight_source(source)
        push = _adapter_push(source)
        if push is not None:
            return self._push_adapter(source, push)
        self._settle()  # the step in flight was computed with the old weights: its tokens carry the old epoch
        started = time.perf_counter()
        policy, held = self._targets(source)
        for target in (policy, *held):
            target.check(source)
        verified = time.perf_counter()
        self.worker.runner.on_refit(source)
        error: BaseException | None = None
        try:
            policy.load(route(source.tensors(self.model), held))
        except Exception as exc:  # noqa: BLE001 - reported below, with what the other ranks did
            error = exc
        replaced, error = self._outcome(policy.replaced, source.partial, error)
        if error is not None or self.incomplete:
            message = str(error) if error is not None else (
                f"{len(self.incomplete)} tensor(s) overwritten by an earlier failed refit were not sent again")
            raise RefitFailed(message, len(replaced), sorted(self.incomplete), self.epoch) from error
        new_epoch = self.epoch + 1 if epoch is None else int(epoch)
        failures = [failure for target in (policy, *held) if (failure := target.commit(new_epoch)) is not None]
        finished = time.perf_counter()
        self.refits += 1
        self.last_refit = {"verify_s": verified - started, "load_s": finished - verified, "total_s": finished - started}
        return {"epoch": self.epoch, **self.last_refit, **({"drafter_error": failures[0]} if failures else {})}

    def _targets(self, source: WeightSource) -> tuple[PolicyTarget, list[WeightTarget]]:
        """The refit's targets: the policy, and those that claim their tensors of the stream before it does (the
        speculative method's MTP layers or drafter, the adapter versions a sharded refit carries)."""
        spec, proposer = self.config.speculative, self.speculator.proposer if self.speculator is not None else None
        held: list[WeightTarget] = [*speculative_targets(spec.method if spec is not None else None, proposer,
                                                         self.model, source.partial),
                                    AdapterTarget(self.loras, source.adapters(), self._live_slots)]
        return PolicyTarget(self.model, source.partial, self._switch), held

    def _outcome(self, replaced: set[str], partial: bool, error: BaseException | None
                 ) -> tuple[set[str], BaseException | None]:
        """Every rank's overwritten tensors (the followers' added to ``replaced``) and the first error of any rank;
        what the engine now holds of two generations is kept in ``incomplete`` (a mix has no epoch: -1, and the
        proposer hears of it)."""
        for names, follower_error in self.worker.runner.refit_outcomes():
            replaced.update(names)
            if error is None and follower_error:
                error = RuntimeError(f"a tensor-parallel rank failed: {follower_error}")
        if error is not None:
            self.incomplete |= replaced
        elif partial:
            self.incomplete -= replaced
        else:
            self.incomplete = set()
        if self.incomplete:
            self.epoch = -1  # a mix of two generations: no epoch describes it
            self._refit_drafter()
        return replaced, error

    def _switch(self, epoch: int) -> None:
        """The policy's commit: nothing cached under the old weights can be found again, and the proposer hears."""
        self.allocator.reset()  # both tiers are keyed by the old epoch: nothing there can be found again
        self.parity.void_all()
        if self.worker.encoder_cache is not None:
            self.worker.encoder_cache.clear()  # embeddings of the old vision weights
        self.epoch = epoch
        self._refit_drafter()

    def _refit_drafter(self) -> None:
        """Tell the speculative proposer the weights changed: a drafter computed under the old ones must not propose."""
        if self.speculator is not None:
            self.speculator.proposer.on_refit(self.epoch)

    def verify_refit(self, source: str | Path | WeightSource) -> float:
        """Check that ``source`` holds weights of this model's names and shapes (no tensor data read);
        returns seconds. Raises ``ValueError`` naming the first mismatch; nothing live is touched.
        """
        started = time.perf_counter()
        source = weight_source(source)
        push = _adapter_push(source)
        if push is None:
            policy, held = self._targets(source)
            for target in (policy, *held):
                target.check(source)
        else:
            require(self.loras).check_push(push, ((s.name, s.shape) for s in source.rendezvous.manifest),
                                           self._live_slots())
        return time.perf_counter() - started

    def _live_slots(self) -> set[int]:
        return {sequence.lora_slot for sequence in self.scheduler.requests.values()}

    def _push_adapter(self, source: RendezvousSource, push: LoraPush) -> dict[str, float]:
        """Receive a trainer's adapter tensors and make them version ``push.version`` of ``push.name``; requests
        running meanwhile keep the version they were admitted under. Raises (nothing changed) when it does not fit."""
        self._settle()
        started = time.perf_counter()
        loras = require(self.loras)
        live = self._live_slots()
        loras.check_push(push, ((s.name, s.shape) for s in source.rendezvous.manifest), live)
        verified = time.perf_counter()
        loras.push(push, source.tensors(self.model), live)
        finished = time.perf_counter()
        return {"epoch": self.epoch, "verify_s": verified - started, "load_s": finished - verified,
                "total_s": finished - started}

    def scale_expert_group(self, size: int) -> dict[str, Any]:
        """SCALE_EP: this rank's part of its expert-parallel group's change of size, which re-places the experts on
        the device at the group's next turn (:meth:`.group.survival.GroupSurvival.scale`)."""
        return self.worker.runner.scale_expert_group(size)

    def reset_prefix_cache(self, reset_running_requests: bool) -> dict[str, Any]:
        """Forget every cached prefix block, on the device and in the host tier (AllBlocksCleared in the KV events).

        As vLLM's scheduler: while requests hold blocks the reset is refused (``reset: false``), unless
        ``reset_running_requests``, which sends them back to the queue to be recomputed from their tokens (their
        outputs so far are kept); the blocks they held are then cached no more either.
        """
        self._settle()
        held = len(self.allocator.blocks_in_use())
        if held and not reset_running_requests:
            logger.info("prefix cache reset refused: running requests hold %d KV block(s)", held)
            return {"reset": False, "held_blocks": held}
        recomputed = len(self.scheduler.evict_all()) if held else 0
        cached = self.allocator.num_cached
        self.allocator.reset(forget_files=True)  # the node's disk tier too: its files of this epoch are removed
        logger.info("prefix cache reset: %d cached block(s) forgotten in every tier%s", cached,
                    f", {recomputed} running request(s) to be recomputed" if recomputed else "")
        return {"reset": True, "forgotten_blocks": cached, "recomputed": recomputed}

    def resume(self) -> None:
        """Bring weights and the KV pool back, then capture the decode graphs over them again.

        KV kept by ``suspend(keep_kv=True)`` is copied back into the pool, unless a refit came in between and
        ``kv_on_refit`` is ``recompute``: then the requests it belonged to are recomputed under the new weights.
        """
        if not (self.suspended or self.weights_offloaded):
            return
        parked, self.parked = self.parked, None
        if parked is not None and parked.epoch != self.epoch and self.config.kv_on_refit == "recompute":
            self.scheduler.evict_all()
            self.allocator.clear_cache()  # the blocks they held: old weights' KV, and no longer in the pool
            parked = None
        self.worker.runner.on_resume(restore=parked is not None)  # the other ranks copy theirs back or drop it
        if self.weights_offloaded:
            self.model.to(self.device)
            self.weights_offloaded = False
        if self.suspended:
            self.kv_cache.allocate()
            if parked is not None:
                parked.restore(self.kv_cache)
            self.suspended = False
        self.worker.runner.capture_graphs(self.kv_cache.layer_caches)


def _adapter_push(source: WeightSource) -> LoraPush | None:
    """The adapter version a trainer's refit carries, or None for base weights."""
    return source.rendezvous.lora if isinstance(source, RendezvousSource) else None
