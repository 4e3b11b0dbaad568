"""``WeightSender``: every trainer rank pushes its own pieces of the weights into a paused fleet, no disk involved.

A trainer sharded over ``world_size`` ranks makes one sender per rank (``rank``), and each calls ``send`` with the
pieces it holds: ``(name, tensor)`` for a whole tensor, ``(name, local, Shard(full_shape, offset))`` for a
rectangle of one. The ranks agree on the manifest over the trainer's own process group (``group``, default the
default one), which refuses pieces that overlap, leave a gap or disagree on a full shape before any engine is
asked. Rank 0 then serves the transfer's store and sends the REFIT (through the coordinator client), whose
verify step checks names and shapes on every engine; every rank then sends each engine rank the chunks of that
rank's regions it holds, point to point (:mod:`megatron_serve.weights.sending`), and the engine ranks load only
once every rank of the transfer committed (:mod:`megatron_serve.weights.sharded`): a rank that dies leaves
every engine on its old weights. Rank 0 hands the acknowledgement (or the refusal) to the other ranks through the
store; each returns it with its own figures in ``detail["sender"]``. Rank 0 waits until each other rank read it
or is gone (:mod:`.roll_call`), so a rank that died costs it no timeout.

``send(..., delta=True)`` sends only the tensors whose chunks changed since what the engines hold (digests on
both sides). ``send(..., drafter=...)`` carries a draft model's tensors (or an EAGLE-3 head's) in the same
REFIT, so speculation switches to the new drafter at the same epoch as the policy (docs/speculative.md).
``send(..., adapters={name: adapter})`` carries LoRA adapter versions in it too: all of them become the served
versions with the policy, under its epoch, or none (docs/rl-fleets.md).

``send_lora`` pushes a LoRA adapter (the same verb, verify step and acknowledgement) from one process, broadcast
to each engine group's rank 0: its tensors become a new version of an adapter, the base weights stay
(docs/lora.md).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping
from urllib.parse import urlparse

import msgspec
import torch

from ..weights import group as transfer
from ..weights.drafter import DRAFTER_PREFIX
from ..model.finite import NonFiniteWeights, first_nonfinite, refuse_nonfinite
from ..weights.manifest import nbytes, pack, plan_buckets, spec_of
from ..weights.sending import FIGURES_AFTER_ANSWER_S, receivers, send_pieces
from ..weights.shards import Item, cover_problem, merge_manifests, piece_of
from ..wire.rendezvous import RENDEZVOUS_SCHEME, LoraPush, Rendezvous
from . import roll_call
from .coordinator_client import ControlError, InferenceClient
from ..weights.adapters import adapter_tensor
from .lora_push import LoraWeights, adapter_push, adapter_update

logger = logging.getLogger("megatron_serve.weights")

DEFAULT_BUCKET_BYTES = 512 << 20
DEFAULT_TIMEOUT_S = 120.0

if TYPE_CHECKING:
    import torch.distributed as dist

# Keys of the transfer's store by which rank 0 stops the other trainer ranks, and hands them the verb's outcome.
_ABORT, _OUTCOME = "sender/abort", "sender/outcome"
#: What a trainer rank that lost rank 0 can say of the fleet.
_FLEET_EPOCH = ("The engines apply nothing unless every rank committed: the coordinator's status says which epoch "
                "they serve")

#: ``on_bucket(index, count, nbytes)``, called on the transfer thread after each bucket left.
BucketCallback = Callable[[int, int, int], None]


def _default_group_ready() -> bool:
    import torch.distributed as dist  # noqa: PLC0415

    return dist.is_available() and dist.is_initialized()


class WeightTransferError(RuntimeError):
    """The sender's side of a transfer failed (engines that never joined, a broken connection).

    ``answer``: what the coordinator said about the same REFIT (a ``ControlError`` naming what each
    engine holds now), when it said it in time.
    """

    def __init__(self, message: str, answer: BaseException | dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.answer = answer


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class WeightSender:
    """Push a trainer rank's pieces of the weights (Hugging Face names and full shapes) into every engine of a fleet.

    ``client``: a started :class:`~megatron_serve.client.coordinator_client.InferenceClient` of the fleet's
    coordinator (the fleet must be PAUSED or SUSPENDED, as for any REFIT; only rank 0 sends the verb).
    ``backend``: ``"gloo"`` (CPU tensors; engines on CPU or GPU) or ``"nccl"`` (GPU to GPU); default ``nccl`` when
    CUDA is available, else ``gloo``. ``bucket_bytes``: the most one message carries (each link holds two in
    flight). ``rank``, ``world_size``: this trainer rank among those that send (every one calls ``send``);
    ``group``: the trainer's ``torch.distributed`` group of those ranks, over which they agree on the manifest
    (default: the default group; not needed for ``world_size`` 1). ``host``: the address engines reach this
    process at, the only one the rendezvous store listens on (default: this machine's address on the route to
    the coordinator, loopback for a coordinator on this machine). The transfer's store keys live under a
    random prefix that only the (encrypted) REFIT carries: see :mod:`megatron_serve.weights.group`.
    ``timeout``: seconds for every engine rank to join, and for each message. ``on_bucket(index, count,
    nbytes)``: progress, called on the transfer thread once each bucket has left.
    """

    def __init__(self, client: InferenceClient, backend: str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, rank: int = 0, world_size: int = 1,
                 group: "dist.ProcessGroup | None" = None, host: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, on_bucket: BucketCallback | None = None) -> None:
        self.client = client
        self.backend = backend or default_backend()
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..world_size - 1 and world_size >= 1, got rank {rank} of {world_size}")
        if world_size > 1 and group is None and not _default_group_ready():
            raise ValueError(f"a WeightSender of world_size {world_size} agrees on the manifest over the trainer's "
                             "torch.distributed group: call torch.distributed.init_process_group first, or pass group=")
        self.bucket_bytes = int(bucket_bytes)
        self.rank, self.world_size, self.group = int(rank), int(world_size), group
        self.host = host
        self.timeout = float(timeout)
        self.on_bucket = on_bucket

    async def send(self, items: Iterable[Item], epoch: int | None = None, delta: bool = False, *,
                   bucket_bytes: int | None = None, drafter: Iterable[Item] | None = None,
                   adapters: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """REFIT the fleet with the pieces every trainer rank sends (any subset of the weights); returns the
        acknowledgement.

        ``items``: ``(name, tensor)`` for a whole tensor, or ``(name, local_tensor, Shard(full_shape, offset))``
        for the piece ``full[offset[i] : offset[i] + local.shape[i]]`` of one. Together the ranks' pieces must
        cover each named tensor exactly once (``ValueError`` on every rank otherwise, before any engine is
        asked). ``epoch`` (default: the fleet's + 1) is stamped on every token generated with them. ``delta``:
        send only the tensors whose bytes changed since what the engines hold (the rest are counted in
        ``detail["sender"]["skipped_bytes"]``). The answer is the verb's (``state``, ``detail`` with ``epoch``,
        ``source`` and per-engine timings), ``detail["sender"]``: this rank's figures (bytes, bytes skipped,
        buckets, seconds, bytes/s, bytes per engine rank), and ``detail["receivers"]``: each engine rank's
        (bytes received, seconds, bytes/s, the bytes it serves, its largest staged tensor). A name or shape
        that does not fit raises :class:`~megatron_serve.client.coordinator_client.ControlError`
        (``refit_failed``); so does a transfer that breaks (a rank that died): every engine keeps its weights.
        A tensor holding NaN or an infinity on any rank raises ``ValueError`` naming it
        (:class:`~megatron_serve.model.finite.NonFiniteWeights`) on every rank before the REFIT is sent.

        ``drafter``: the draft model's (or EAGLE-3 head's) ``(name, tensor)`` pairs (its checkpoint's names),
        sent in the same transaction as ``drafter.`` + name and loaded under the same epoch by every engine's
        drafter (an engine without one refuses the refit before any weight changed). Names already prefixed
        ``drafter.`` among ``items`` are the drafter's too (what ``MegatronLLM.refit`` passes on). Without
        them each engine's drafter goes stale: it proposes nothing under the new epoch (docs/speculative.md).

        ``adapters``: ``{name: adapter}``, LoRA adapters to serve under ``name`` from this refit on, each a PEFT
        model, a PEFT directory, or ``(state dict, LoraConfig)``; given on one trainer rank (an adapter from two
        ranks is refused). Each becomes version ``epoch`` of its name (``lora_epochs`` on its tokens), in the same
        transaction as the policy: every engine checks all of them before any byte moves and registers them only
        once the policy loaded, so an adapter that does not fit (shapes, rank, an older version) refuses the whole
        refit and the fleet keeps its weights, its epoch and its adapters. ``detail["adapters"]``: name -> version.
        Requests admitted under an older version finish under it. Engines need ``enable_lora``.
        """
        pushes = [adapter_update(name, value, 0) for name, value in (adapters or {}).items()]  # version: below
        local = [*(piece_of(item, self.rank) for item in items),
                 *(piece_of(item, self.rank, DRAFTER_PREFIX) for item in (drafter or ())),
                 *(piece_of((adapter_tensor(push.name, name), tensor), self.rank)
                   for named, push in pushes for name, tensor in named)]
        poisoned = first_nonfinite((spec.name, tensor) for spec, _, tensor in local)
        gathered = await self._all_gather(([(spec, piece) for spec, piece, _ in local], poisoned,
                                           [push for _, push in pushes]))
        poisoned = next((name for _, name, _ in gathered if name is not None), None)
        if poisoned is not None:  # the verify step: every rank refuses, before the REFIT, no byte moved
            raise NonFiniteWeights(poisoned, "the weights to send")
        carried = [push for _, _, theirs in gathered for push in theirs]
        names = [push.name for push in carried]
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA adapter(s) {sorted({n for n in names if names.count(n) > 1})} given by more than "
                             "one trainer rank: give each adapter on one rank")
        manifest, pieces = merge_manifests([pairs for pairs, _, _ in gathered])
        problem = cover_problem(manifest, pieces) if manifest else (
            "no weights given: pass (name, tensor) pairs, e.g. model.named_parameters()")
        if problem is not None:
            raise ValueError(problem)
        mine = dict(zip((j for j, p in enumerate(pieces) if p.rank == self.rank), (t for _, _, t in local)))
        rendezvous = Rendezvous(address="", prefix="", backend=self.backend,
                                bucket_bytes=int(bucket_bytes or self.bucket_bytes), manifest=manifest,
                                timeout_s=self.timeout, pieces=pieces, senders=self.world_size, delta=bool(delta))
        if self.rank == 0:
            if carried:  # each adapter becomes version ``epoch`` of its name: the epoch is fixed here
                epoch = epoch if epoch is not None else int((await self.client.status())["epoch"]) + 1
                rendezvous = msgspec.structs.replace(rendezvous, adapters=[
                    msgspec.structs.replace(push, version=epoch) for push in carried])
            return await self._lead(rendezvous, mine, epoch)
        return await self._follow(rendezvous, mine)

    async def _all_gather(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        return await asyncio.to_thread(self._collective, "all_gather", value)

    def _collective(self, kind: str, value: Any) -> Any:
        """Over the trainer's own group (a separate world from the transfer's): gather, or rank 0's value."""
        import torch.distributed as dist  # noqa: PLC0415 - torch's distributed package only for sharded trainers

        if dist.get_world_size(self.group) != self.world_size or dist.get_rank(self.group) != self.rank:
            raise ValueError(f"this sender is rank {self.rank} of {self.world_size}, but its group says rank "
                             f"{dist.get_rank(self.group)} of {dist.get_world_size(self.group)}")
        if kind == "all_gather":
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, value, group=self.group)
            return out
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                   group=self.group)
        return box[0]

    async def _lead(self, rendezvous: Rendezvous, mine: dict[int, torch.Tensor], epoch: int | None
                    ) -> dict[str, Any]:
        """Rank 0: serve the store, tell the other ranks where, send the REFIT and this rank's chunks."""
        host = self.host or transfer.local_address_towards(urlparse(self.client.address).hostname or "127.0.0.1")
        listening = transfer.serve_store(host, self.timeout)
        prefix = secrets.token_hex(16)  # this transfer's keys: only the REFIT (encrypted) carries it
        store = transfer.transfer_store(listening, prefix)
        rendezvous = msgspec.structs.replace(rendezvous, address=f"{host}:{listening.port}", prefix=prefix)
        ranks = roll_call.RollCall(host, prefix, self.world_size) if self.world_size > 1 else None
        try:
            if ranks is not None:
                await asyncio.to_thread(self._collective, "broadcast", (rendezvous.address, prefix, ranks.port))
            label = f"{RENDEZVOUS_SCHEME}{host}:{listening.port}"
            try:
                ack, figures = await self._refit(store, label, rendezvous, mine, host, epoch)
            except Exception as exc:
                await asyncio.to_thread(self._publish, store, ranks, exc)
                raise
            detail = ack.setdefault("detail", {})
            detail["receivers"] = await asyncio.to_thread(receivers, store, self.world_size, figures["world_size"],
                                                          min(self.timeout, FIGURES_AFTER_ANSWER_S))
            await asyncio.to_thread(self._publish, store, ranks, ack)
        finally:
            if ranks is not None:
                ranks.close()
        detail["sender"] = figures
        return ack

    async def _refit(self, store: Any, label: str, rendezvous: Rendezvous, mine: dict[int, torch.Tensor], host: str,
                     epoch: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The REFIT verb and rank 0's part of the transfer side by side; the acknowledgement and rank 0's figures."""
        cancelled = threading.Event()
        verb = asyncio.ensure_future(self.client.refit(label, epoch, rendezvous=rendezvous))
        moving = asyncio.ensure_future(asyncio.to_thread(
            send_pieces, store, rendezvous, 0, mine, host, cancelled.is_set, self.on_bucket))
        try:
            await asyncio.wait({verb, moving}, return_when=asyncio.FIRST_COMPLETED)
            if verb.done() and verb.exception() is not None and not moving.done():
                cancelled.set()  # refused before the bytes moved (verify), or an engine gave up midway
                store.set(_ABORT, "1")
                await asyncio.gather(moving, return_exceptions=True)
                return verb.result(), {}  # raises the coordinator's answer
            try:
                figures = await moving
            except Exception as exc:
                answer = await self._answer_within(verb, self.timeout)
                if isinstance(answer, ControlError):
                    raise answer from exc
                raise WeightTransferError(f"sending the weights to the fleet failed: {exc}", answer) from exc
            return await verb, figures
        finally:
            cancelled.set()
            if not verb.done():
                verb.cancel()

    def _publish(self, store: Any, ranks: roll_call.RollCall | None, outcome: dict[str, Any] | Exception) -> None:
        """Hand the verb's outcome to the other trainer ranks, and wait until each read it or is gone (up to the
        timeout for one that is neither): the store is this process's, and goes with this call."""
        if ranks is None:
            return
        if isinstance(outcome, ControlError):
            value = ("refused", outcome.code, str(outcome), outcome.detail)
        elif isinstance(outcome, Exception):
            value = ("failed", str(outcome))
        else:
            value = ("ack", outcome)
        store.set(_OUTCOME, pickle.dumps(value))
        ranks.wait(time.monotonic() + self.timeout)

    async def _follow(self, rendezvous: Rendezvous, mine: dict[int, torch.Tensor]) -> dict[str, Any]:
        """Ranks other than 0: send this rank's chunks once rank 0 says where, then return rank 0's outcome."""
        address, prefix, port = await asyncio.to_thread(self._collective, "broadcast", None)
        rendezvous = msgspec.structs.replace(rendezvous, address=address, prefix=prefix)
        # here until this rank read the outcome: rank 0 waits for it while it is, and no longer once it is gone
        host = address.rpartition(":")[0]
        try:
            present = await asyncio.to_thread(roll_call.attend, host, port, prefix, self.rank, self.timeout)
        except OSError as exc:
            raise WeightTransferError(f"trainer rank 0, which serves the transfer's store, cannot be reached at "
                                      f"{host}:{port} ({exc}); this rank sent nothing. {_FLEET_EPOCH}") from exc
        try:
            figures, outcome = await self._send_and_read(rendezvous, mine, address, prefix)
        except BaseException:
            present.close()
            raise
        roll_call.read(present)
        if outcome[0] == "refused":
            raise ControlError(outcome[1], outcome[2], outcome[3])
        if outcome[0] == "failed":
            raise WeightTransferError(f"sending the weights to the fleet failed: {outcome[1]}")
        if not isinstance(figures, dict):
            raise WeightTransferError(f"this rank's part of the transfer failed: {figures}")
        ack = outcome[1]
        ack.setdefault("detail", {})["sender"] = figures
        return ack

    async def _send_and_read(self, rendezvous: Rendezvous, mine: dict[int, torch.Tensor], address: str, prefix: str
                             ) -> tuple[dict[str, Any] | Exception | None, tuple]:
        """A rank other than 0: its chunks, then rank 0's outcome; its figures (or why its part failed) and it."""
        store = transfer.connect(address, prefix, self.timeout)
        host = transfer.local_address_towards(address.rpartition(":")[0])
        figures: dict[str, Any] | Exception | None
        try:
            figures = await asyncio.to_thread(send_pieces, store, rendezvous, self.rank, mine, host,
                                              lambda: store.check([_ABORT]), self.on_bucket)
        except transfer.Cancelled:
            figures = None
        except Exception as exc:  # noqa: BLE001 - rank 0's outcome says what the fleet did; this is why
            figures = exc
        try:
            return figures, pickle.loads(await asyncio.to_thread(transfer.wait_for_key, store, _OUTCOME, float("inf")))
        except RuntimeError as exc:  # its store is gone with it: what the fleet did, only the coordinator knows
            why = figures if isinstance(figures, Exception) else "this rank's part went through"
            raise WeightTransferError(f"trainer rank 0, which serves the transfer's store and sent the REFIT, is gone "
                                      f"({exc}); this rank: {why}. {_FLEET_EPOCH}") from exc

    async def send_lora(self, name: str, weights: LoraWeights, *, version: int, rank: int | None = None,
                        alpha: float | None = None, use_rslora: bool = False, target_modules: list[str] | None = None,
                        target_parameters: list[str] | None = None, bucket_bytes: int | None = None
                        ) -> dict[str, Any]:
        """Push a LoRA adapter as version ``version`` of adapter ``name`` on every engine; returns the acknowledgement.

        ``weights``: a PEFT model (its active adapter; rank, alpha, rsLoRA and targets come from its config),
        a PEFT state dict (``get_peft_model_state_dict``, or names with the adapter's name in them), or
        ``{module: (lora_A, lora_B)}`` with module paths such as ``model.layers.0.self_attn.q_proj``; then
        ``rank`` and ``alpha`` are needed (and ``target_parameters`` for MoE experts, as PEFT's config names
        them). Engines need ``enable_lora``. Requests already admitted under an older version finish under it,
        later ones get this one (``detail["lora"]`` names it); the base weights and the fleet's epoch stay. A
        name, shape, rank or version that does not fit raises
        :class:`~megatron_serve.client.coordinator_client.ControlError` (``refit_failed``) with nothing changed.
        """
        named, push = adapter_push(name, weights, version=version, rank=rank, alpha=alpha, use_rslora=use_rslora,
                                   target_modules=target_modules, target_parameters=target_parameters)
        return await self._push(named, None, bucket_bytes, push)

    async def _push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], epoch: int | None,
                    bucket_bytes: int | None, lora: LoraPush | None) -> dict[str, Any]:
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        manifest = [spec_of(name, tensor) for name, tensor in named]
        refuse_nonfinite(named, "the weights to send")  # the verify step: before the REFIT, no byte moved
        seen: set[str] = set()
        for spec in manifest:
            if spec.name in seen:
                raise ValueError(f"tensor {spec.name!r} is given twice")
            seen.add(spec.name)
        if not manifest:
            raise ValueError("no weights given: pass (name, tensor) pairs, e.g. model.named_parameters()")
        size = int(bucket_bytes or self.bucket_bytes)
        host = self.host or transfer.local_address_towards(urlparse(self.client.address).hostname or "127.0.0.1")
        listening = transfer.serve_store(host, self.timeout)
        prefix = secrets.token_hex(16)  # this transfer's keys: only the REFIT (encrypted) carries it
        store = transfer.transfer_store(listening, prefix)
        rendezvous = Rendezvous(address=f"{host}:{listening.port}", prefix=prefix, backend=self.backend,
                                bucket_bytes=size, manifest=manifest, timeout_s=self.timeout, lora=lora)
        label = f"{RENDEZVOUS_SCHEME}{host}:{listening.port}"
        cancelled = threading.Event()
        verb = asyncio.ensure_future(self.client.refit(label, epoch, rendezvous=rendezvous))
        moving = asyncio.ensure_future(asyncio.to_thread(
            self._transfer, store, rendezvous, [t for _, t in named], host, cancelled))
        try:
            await asyncio.wait({verb, moving}, return_when=asyncio.FIRST_COMPLETED)
            if verb.done() and verb.exception() is not None and not moving.done():
                cancelled.set()  # refused before the bytes moved (verify), or an engine gave up midway
                await asyncio.gather(moving, return_exceptions=True)
                return verb.result()  # raises the coordinator's answer
            try:
                figures = await moving
            except Exception as exc:
                answer = await self._answer_within(verb, self.timeout)
                raise WeightTransferError(f"sending the weights to the fleet failed: {exc}", answer) from exc
            ack = await verb
        finally:
            cancelled.set()
            if not verb.done():
                verb.cancel()
        ack.setdefault("detail", {})["sender"] = figures
        return ack

    @staticmethod
    async def _answer_within(verb: "asyncio.Future[dict[str, Any]]", timeout: float
                             ) -> BaseException | dict[str, Any] | None:
        try:
            return await asyncio.wait_for(asyncio.shield(verb), timeout)
        except ControlError as refused:
            return refused
        except asyncio.TimeoutError:
            return None

    def _transfer(self, store: Any, rendezvous: Rendezvous, tensors: list[torch.Tensor], host: str,
                  cancelled: threading.Event) -> dict[str, Any]:
        """The transfer thread: wait for every engine rank, build the group, broadcast each bucket."""
        started = time.perf_counter()
        world_size = transfer.wait_for_ranks(store, time.monotonic() + self.timeout, cancelled.is_set)
        group = transfer.process_group(store, 0, world_size, self.backend, self.timeout, host)
        joined = time.perf_counter()
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        buckets = plan_buckets(rendezvous.manifest, rendezvous.bucket_bytes)
        sent = sum(nbytes(spec) for spec in rendezvous.manifest)  # the tensors' bytes (buckets add alignment)

        def landed(index: int, flight: tuple[torch.Tensor, Any]) -> None:
            flight[1].wait()
            if self.on_bucket is not None:
                self.on_bucket(index, len(buckets), flight[0].numel())

        try:
            in_flight = None  # the bucket on the wire while the next one is packed
            for index, bucket in enumerate(buckets):
                buffer = pack(bucket, tensors, device)
                if in_flight is not None:
                    landed(index - 1, in_flight)
                in_flight = (buffer, transfer.broadcast(group, buffer))
            landed(len(buckets) - 1, in_flight)
        finally:
            transfer.close(group)
        finished = time.perf_counter()
        seconds = finished - joined
        logger.info("sent %d bytes in %d bucket(s) to %d engine rank(s) in %.3fs", sent, len(buckets),
                    world_size - 1, seconds)
        return {"bytes": sent, "buckets": len(buckets), "world_size": world_size, "backend": self.backend,
                "rendezvous_s": round(joined - started, 6), "transfer_s": round(seconds, 6),
                "bytes_per_s": round(sent / seconds) if seconds > 0 else None}
