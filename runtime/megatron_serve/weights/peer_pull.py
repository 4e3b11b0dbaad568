"""Late joiners copy the fleet's current weights from a live engine of their layout (issue 50, RL).

Weights a trainer sent exist nowhere on disk, so an engine that registers after such a refit (a restart, a
scale-up) has nothing to load them from. The coordinator pairs it with a live engine at the fleet's epoch whose
layout is the same (:func:`layout_digest`: every state tensor's name, shape and dtype, so the same model,
parallel sizes, dtype and quantization; and as many ranks), the *donor*, and hands both a random prefix: the joiner
in its registration, with the donor's store address; the donor in a ``PEER_WEIGHTS`` message. The donor keeps a
``torch.distributed`` TCP store listening once it serves weights a trainer sent (:class:`PeerWeights`); every rank
of both engines meets there under the prefix. A group of ``R`` ranks (tensor-parallel ranks times pipeline stages)
pulls rank to rank: the donor's rank ``r`` is rank ``r`` of a gloo group of ``2 R``, the joiner's rank ``r`` is
rank ``R + r``, and each donor rank sends every state tensor of its own model to its joiner rank as its bytes are
(quantized weights and their scales included: the layouts match, nothing is converted), in buckets, point to point,
all pairs at once, between two of the donor's steps (its requests wait for that long). The donor's leader tells
its other ranks through its plan channel (``followers``); the joiner's ranks run their refit path
(:class:`PeerSource`), so its epoch, prefix cache and drafter change as after any refit.

Every joiner rank checks its donor rank's digest, epoch and group size before any byte moves, and all of them must
agree (one refusal stops both engines); a pull that fails anyway (a donor that died midway) fails the commit on
every rank and the joiner's registration, which ends it, as a checkpoint it cannot read would.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import pickle
import time
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
import torch.distributed as dist

from ..model.llama import LlamaForCausalLM
from ..wire.rendezvous import LoraPush, PeerShare
from . import group as transfer
from .digests import forget_digests

logger = logging.getLogger("megatron_serve.weights")

BUCKET_BYTES = 64 << 20
#: Seconds a joiner tries to reach its donor's store. The store listens from before the coordinator hands its address
#: out, for as long as the donor lives: when it does not answer, the donor died (killed between the pairing and the
#: pull), and the pull fails now, not after the whole pull's timeout (the weights deadline, 15 minutes by default)
#: in which TCPStore's client retried while the requests routed to the joiner waited.
REACH_S = 10.0
_ALIGN = 64  # every tensor starts at a multiple: a bucket's bytes view as any dtype in place
_DONOR, _READY, _REFUSED = "peer/donor", "peer/ready", "peer/refused"
_CPU = torch.device("cpu")


def group_ranks(model: LlamaForCausalLM) -> int:
    """The ranks of ``model``'s engine: tensor-parallel ranks times pipeline stages."""
    return model.tp.size * model.tp.stage.size


class Followers(Protocol):
    """The donor leader's other ranks (its runner): told to share with :meth:`on_share`, heard back from with
    :meth:`share_outcomes` (each rank's error, or None)."""

    def on_share(self, payload: tuple[str, str, int, float]) -> None: ...

    def share_outcomes(self) -> list[str | None]: ...


def layout_digest(model: LlamaForCausalLM) -> str:
    """What two engines must share for one's state tensors to be the other's, byte for byte."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return digest.hexdigest()


def _buckets(state: dict[str, torch.Tensor], limit: int) -> list[tuple[list[tuple[str, int]], int]]:
    """The state's tensors in order, cut into buckets of at most ``limit`` bytes (a larger tensor alone): each a
    list of ``(name, offset)`` and its size. Both sides cut the same way (same layout, same order)."""
    out: list[tuple[list[tuple[str, int]], int]] = []
    current: list[tuple[str, int]] = []
    used = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and used + nbytes > limit:
            out.append((current, used))
            current, used = [], 0
        current.append((name, used))
        used = -(-(used + nbytes) // _ALIGN) * _ALIGN
    if current:
        out.append((current, used))
    return out


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class PeerWeights:
    """An engine's side of peer pulls as a donor: the store where joiners meet it (listening from the first time
    :meth:`address` is asked, i.e. once it serves weights a trainer sent) and :meth:`share`; ``followers``: the
    engine's other ranks (None: it has none)."""

    def __init__(self, model: LlamaForCausalLM, timeout: float = 120.0, followers: Followers | None = None) -> None:
        self.model = model
        self.timeout = timeout
        self.followers = followers
        self._store: dist.TCPStore | None = None
        self._host = ""

    def address(self, towards: str) -> str:
        """``host:port`` of this engine's store, on its route to ``towards`` (the coordinator's host)."""
        if self._store is None:
            self._host = transfer.local_address_towards(towards)
            self._store = transfer.serve_store(self._host, self.timeout)
        return f"{self._host}:{self._store.port}"

    def share(self, ask: PeerShare, served_epoch: int) -> dict[str, float] | None:
        """``PEER_WEIGHTS``: every rank of this engine sends its state (it serves ``served_epoch``) to the joiner's
        same rank, which meets it under ``ask.prefix`` (the joiner refuses another layout or epoch before any byte
        moves). Returns this rank's bytes sent and the seconds, or None when it failed (logged: the joiner's
        registration fails, this engine serves on)."""
        if self._store is None:
            logger.warning("engine %s asked for our weights, but we serve none a trainer sent", ask.engine_id)
            return None
        if self.followers is not None:  # the other ranks send theirs at the same time, to their joiner ranks
            self.followers.on_share((f"{self._host}:{self._store.port}", ask.prefix, served_epoch, ask.timeout_s))
        try:
            sent = share_rank(self.model, transfer.transfer_store(self._store, ask.prefix), self._host, served_epoch,
                              ask.timeout_s)
        except transfer.Cancelled:
            logger.warning("engine %s refused our weights (epoch %d, layout %s)", ask.engine_id, served_epoch,
                           layout_digest(self.model))
            sent = None
        except (RuntimeError, TimeoutError, ValueError) as exc:
            logger.warning("engine %s could not pull our weights: %s", ask.engine_id, exc)
            sent = None
        failed = [why for why in (self.followers.share_outcomes() if self.followers is not None else []) if why]
        if sent is None or failed:
            if failed:
                logger.warning("engine %s could not pull our other ranks' weights: %s", ask.engine_id, failed[0])
            return None
        logger.info("sent our weights (epoch %d, %d bytes from rank 0) to engine %s in %.2fs", served_epoch,
                    sent["bytes"], ask.engine_id, sent["seconds"])
        return sent


def share_rank(model: LlamaForCausalLM, store: dist.Store, host: str, served_epoch: int, timeout: float
               ) -> dict[str, float]:
    """One donor rank's part of a pull: say what it holds, wait until every joiner rank agreed (:class:`transfer.
    Cancelled` when one refused), then send its state to its joiner rank and join the commit."""
    started = time.perf_counter()
    rank, ranks = model.tp.engine_rank, group_ranks(model)
    store.set(f"{_DONOR}/{rank}", pickle.dumps({"epoch": served_epoch, "layout": layout_digest(model), "ranks": ranks}))
    deadline = time.monotonic() + timeout
    for joiner in range(ranks):
        transfer.wait_for_key(store, f"{_READY}/{joiner}", deadline, lambda: store.check([_REFUSED]))
    sent = transfer.commit_after(transfer.process_group(store, rank, 2 * ranks, "gloo", timeout, host), _CPU,
                                 lambda group: _send_state(model, group, ranks + rank))
    return {"bytes": sent, "seconds": time.perf_counter() - started}


def _send_state(model: LlamaForCausalLM, group: dist.ProcessGroup, joiner: int) -> int:
    """Every state tensor's bytes to rank ``joiner`` of ``group``, in buckets; the bytes sent."""
    sent = 0
    state = model.state_dict()
    for names, size in _buckets(state, BUCKET_BYTES):
        buffer = torch.empty(size, dtype=torch.uint8)
        for name, offset in names:
            data = _bytes_of(state[name])
            buffer[offset:offset + data.numel()].copy_(data)
        group.send([buffer], joiner, 0).wait()
        sent += size
    return sent


def follow_share(model: LlamaForCausalLM, payload: tuple[str, str, int, float]) -> str | None:
    """A donor's other rank: its part of the pull the leader was asked for (``payload``: the leader's store address,
    the prefix, the epoch, the timeout); returns why it failed, or None. Never raises (the group stays in lockstep)."""
    address, prefix, served_epoch, timeout = payload
    try:
        store = transfer.connect(address, prefix, timeout)
        share_rank(model, store, transfer.local_address_towards(address.rpartition(":")[0]), served_epoch, timeout)
    except transfer.Cancelled:
        return None  # the joiner refused: the leader says so
    except (RuntimeError, TimeoutError, ValueError) as exc:
        return str(exc) or type(exc).__name__
    return None


@dataclass(frozen=True)
class PeerSource:
    """The fleet's current weights (epoch ``epoch``) from a donor's store at ``address``, under ``prefix``; a refit
    source as :mod:`.sources` describes them. Its tensors are the model's own state, which it writes in place as
    they arrive: the stream it hands the loader is empty."""

    address: str
    prefix: str
    epoch: int
    timeout_s: float
    label: str
    partial: bool = True

    def check(self, model: LlamaForCausalLM) -> None:
        """Nothing to check before the donor is reached: :meth:`tensors` compares its layout and epoch first."""

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """None named: the donor's state is the policy's own, checked against its layout when reached."""
        return []

    def adapters(self) -> tuple[LoraPush, ...]:
        return ()

    def tensors(self, model: LlamaForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's part: check its donor rank, wait until every rank of this engine did, receive its state."""
        forget_digests(model)  # a later delta must compare against nothing this rank was sent by a trainer
        rank, ranks = model.tp.engine_rank, group_ranks(model)
        deadline = time.monotonic() + self.timeout_s
        store = self._donor_store()
        refused = lambda: store.check([_REFUSED])  # noqa: E731 - another rank of either engine gave up
        try:
            donor = pickle.loads(transfer.wait_for_key(store, f"{_DONOR}/{rank}", deadline, refused))
            problem = self._problem(donor, model, rank, ranks)
            if problem is not None:
                store.set(_REFUSED, problem)  # the donor's ranks and ours stop waiting and step on
                raise ValueError(problem)
            store.set(f"{_READY}/{rank}", "1")
            for other in range(ranks):
                transfer.wait_for_key(store, f"{_READY}/{other}", deadline, refused)
        except transfer.Cancelled:
            raise ValueError(f"the pull from {self.address} was refused: {store.get(_REFUSED).decode()}") from None
        host = transfer.local_address_towards(self.address.rpartition(":")[0])
        transfer.commit_after(transfer.process_group(store, ranks + rank, 2 * ranks, "gloo", self.timeout_s, host),
                              _CPU, lambda group: _receive_state(model, group, rank))
        yield from ()

    def _donor_store(self) -> dist.PrefixStore:
        """The donor's store, reached within :data:`REACH_S` (or raises: its engine is gone), then waited on for the
        pull's whole timeout."""
        try:
            store = transfer.connect(self.address, self.prefix, min(REACH_S, self.timeout_s))
        except RuntimeError as exc:  # torch's DistNetworkError and DistStoreError
            raise RuntimeError(f"the donor's store at {self.address} did not answer within {REACH_S:g}s: its engine is "
                               f"gone ({str(exc).splitlines()[0]})") from None
        store.set_timeout(datetime.timedelta(seconds=self.timeout_s))
        return store

    def _problem(self, donor: dict, model: LlamaForCausalLM, rank: int, ranks: int) -> str | None:
        if donor.get("ranks", 1) != ranks:
            return f"the donor at {self.address} has {donor.get('ranks', 1)} rank(s), this engine {ranks}"
        if donor["layout"] != layout_digest(model):
            return (f"the donor at {self.address} does not hold this engine's layout on rank {rank} (another model, "
                    "parallel size, dtype or quantization)")
        if donor["epoch"] != self.epoch:
            return f"the donor at {self.address} serves epoch {donor['epoch']}, not the fleet's {self.epoch}"
        return None


def _receive_state(model: LlamaForCausalLM, group: dist.ProcessGroup, donor: int) -> None:
    """Every state tensor of ``model`` written in place from rank ``donor`` of ``group``, in buckets."""
    with torch.no_grad():
        state = model.state_dict()
        for names, size in _buckets(state, BUCKET_BYTES):
            buffer = torch.empty(size, dtype=torch.uint8)
            group.recv([buffer], donor, 0).wait()
            for name, offset in names:
                target = state[name]
                nbytes = target.numel() * target.element_size()
                target.copy_(buffer[offset:offset + nbytes].view(target.dtype).view(target.shape))
