"""Late joiners copy the fleet's current weights from a live engine of their layout (issue 50, RL).

Weights a trainer sent exist nowhere on disk, so an engine that registers after such a refit (a restart, a
scale-up) has nothing to load them from. The coordinator pairs it with a live engine at the fleet's epoch whose
layout is the same (:func:`layout_digest`: every state tensor's name, shape and dtype, so the same model,
parallel sizes, dtype and quantization), the *donor*, and hands both a random prefix: the joiner in its
registration, with the donor's store address; the donor in a ``PEER_WEIGHTS`` message. The donor keeps a
``torch.distributed`` TCP store listening once it serves weights a trainer sent (:class:`PeerWeights`); both meet
there under the prefix, build a two-rank gloo group, and the donor sends every state tensor of its model as its
bytes are (quantized weights and their scales included: the layouts match, nothing is converted), in buckets,
point to point, between two of its steps (its requests wait for that long). The joiner receives them through
its refit path (:class:`PeerSource`), so its epoch, prefix cache and drafter change as after any refit.

A joiner checks the donor's digest and epoch before any byte moves; a pull that fails anyway (a donor that died
midway) fails the joiner's registration, which ends it, as a checkpoint it cannot read would.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from ..model.llama import LlamaForCausalLM
from ..wire.messages import PeerShare
from . import group as transfer
from .digests import forget_digests

logger = logging.getLogger("megatron_serve.weights")

BUCKET_BYTES = 64 << 20
_ALIGN = 64  # every tensor starts at a multiple: a bucket's bytes view as any dtype in place
_DONOR, _JOINED, _REFUSED = "peer/donor", "peer/joined", "peer/refused"
_CPU = torch.device("cpu")


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
    :meth:`address` is asked, i.e. once it serves weights a trainer sent) and :meth:`share`."""

    def __init__(self, model: LlamaForCausalLM, timeout: float = 120.0) -> None:
        self.model = model
        self.timeout = timeout
        self._store: dist.TCPStore | None = None
        self._host = ""

    def address(self, towards: str) -> str:
        """``host:port`` of this engine's store, on its route to ``towards`` (the coordinator's host)."""
        if self._store is None:
            self._host = transfer.local_address_towards(towards)
            self._store = transfer.serve_store(self._host, self.timeout)
        return f"{self._host}:{self._store.port}"

    def share(self, ask: PeerShare, served_epoch: int) -> dict[str, float] | None:
        """``PEER_WEIGHTS``: send this engine's state (it serves ``served_epoch``) to the joiner that meets it under
        ``ask.prefix`` (the joiner refuses another layout or epoch before any byte moves). Returns the bytes sent
        and the seconds, or None when it failed (logged: the joiner's registration fails, this engine serves on)."""
        try:
            sent = self._send(ask.prefix, served_epoch, ask.timeout_s)
        except transfer.Cancelled:
            logger.warning("engine %s refused our weights (epoch %d, layout %s)", ask.engine_id, served_epoch,
                           layout_digest(self.model))
            return None
        except (RuntimeError, TimeoutError, ValueError) as exc:
            logger.warning("engine %s could not pull our weights: %s", ask.engine_id, exc)
            return None
        logger.info("sent our weights (epoch %d, %d bytes) to engine %s in %.2fs", served_epoch, sent["bytes"],
                    ask.engine_id, sent["seconds"])
        return sent

    def _send(self, prefix: str, served_epoch: int, timeout: float) -> dict[str, float]:
        if self._store is None:
            raise RuntimeError("this engine opened no store for peers (it serves no weights a trainer sent)")
        started = time.perf_counter()
        store = transfer.transfer_store(self._store, prefix)
        store.set(_DONOR, pickle.dumps({"epoch": served_epoch, "layout": layout_digest(self.model)}))
        transfer.wait_for_key(store, _JOINED, time.monotonic() + timeout, lambda: store.check([_REFUSED]))
        group = transfer.process_group(store, 0, 2, "gloo", timeout, self._host)
        sent = 0
        try:
            state = self.model.state_dict()
            for names, size in _buckets(state, BUCKET_BYTES):
                buffer = torch.empty(size, dtype=torch.uint8)
                for name, offset in names:
                    data = _bytes_of(state[name])
                    buffer[offset:offset + data.numel()].copy_(data)
                group.send([buffer], 1, 0).wait()
                sent += size
            transfer.commit(group, _CPU)
        finally:
            transfer.close(group)
        return {"bytes": sent, "seconds": time.perf_counter() - started}


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

    def tensors(self, model: LlamaForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
        forget_digests(model)  # a later delta must compare against nothing this rank was sent by a trainer
        deadline = time.monotonic() + self.timeout_s
        store = transfer.connect(self.address, self.prefix, self.timeout_s)
        donor = pickle.loads(transfer.wait_for_key(store, _DONOR, deadline))
        problem = None
        if donor["layout"] != layout_digest(model):
            problem = (f"the donor at {self.address} does not hold this engine's layout (another model, parallel "
                       "size, dtype or quantization)")
        elif donor["epoch"] != self.epoch:
            problem = f"the donor at {self.address} serves epoch {donor['epoch']}, not the fleet's {self.epoch}"
        if problem is not None:
            store.set(_REFUSED, problem)  # the donor stops waiting for us and steps on
            raise ValueError(problem)
        host = transfer.local_address_towards(self.address.rpartition(":")[0])
        store.set(_JOINED, "1")
        group = transfer.process_group(store, 1, 2, "gloo", self.timeout_s, host)
        try:
            with torch.no_grad():
                state = model.state_dict()
                for names, size in _buckets(state, BUCKET_BYTES):
                    buffer = torch.empty(size, dtype=torch.uint8)
                    group.recv([buffer], 0, 0).wait()
                    for name, offset in names:
                        target = state[name]
                        nbytes = target.numel() * target.element_size()
                        target.copy_(buffer[offset:offset + nbytes].view(target.dtype).view(target.shape))
            transfer.commit(group, _CPU)
        finally:
            transfer.close(group)
        yield from ()
