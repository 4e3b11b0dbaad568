"""The weights' vocabulary on the wire: what a trainer sends (its manifest, its pieces, a LoRA push), where and
how it travels (a REFIT's ``Rendezvous``), and a joining engine's pull from a peer (``PEER_WEIGHTS``).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .body import Body


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One tensor a trainer sends: its Hugging Face checkpoint name, full (unsharded) shape and dtype."""

    name: str
    shape: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]
    dtype: str  # a key of TRANSFER_DTYPES


class PieceSpec(msgspec.Struct, array_like=True, frozen=True):
    """A rectangular piece of one manifest tensor that trainer rank ``rank`` holds and sends:
    ``full[offset[i] : offset[i] + shape[i]]`` on every dim (megatron_serve.weights.shards)."""

    name: str
    rank: Annotated[int, msgspec.Meta(ge=0)]
    offset: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]
    shape: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]


#: The ``source`` of a REFIT whose weights come from a trainer (``rendezvous://host:port``): a label, not a path.
RENDEZVOUS_SCHEME = "rendezvous://"

#: Floating dtypes a trainer may send, by wire name, with their size in bytes.
TRANSFER_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
TRANSFER_BACKENDS = ("gloo", "nccl")
MIN_PREFIX_CHARS = 32  # a rendezvous prefix: 128 random bits as hex


class LoraPush(msgspec.Struct, frozen=True):
    """A rendezvous whose tensors are a LoRA adapter, not base weights: they become version ``version`` of
    adapter ``name`` on every engine (``engine.lora``); the base weights and their epoch stay as they are.

    The manifest's names are PEFT's (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``);
    ``rank``, ``alpha`` and ``use_rslora`` are the adapter config's (scaling ``alpha / rank``, or
    ``alpha / sqrt(rank)`` with rsLoRA); ``target_modules``, when given, bounds the projections it may touch;
    ``target_parameters`` names the MoE expert parameters it targets (PEFT's names of their tensors depend on it).
    """

    name: str
    version: Annotated[int, msgspec.Meta(ge=0)]
    rank: Annotated[int, msgspec.Meta(ge=1)]
    alpha: float
    use_rslora: bool = False
    target_modules: list[str] | None = None
    target_parameters: list[str] | None = None


class Rendezvous(Body):
    """A REFIT source that is a trainer process, not a directory: where and how the weights travel.

    The sender (rank 0) serves a ``torch.distributed`` TCP store at ``address``; every rank of every
    engine group joins one process group with it (``backend``) and receives the tensors of
    ``manifest``, in that order, packed into buckets of up to ``bucket_bytes`` bytes
    (:func:`megatron_serve.weights.manifest.plan_buckets` cuts them the same way on both sides).
    The coordinator adds ``world_size`` and this engine's ``rank_offset`` to the load step.
    With ``pieces`` (a sharded refit) the ``senders`` trainer ranks are ranks 0 .. senders - 1 and each
    sends every engine rank only the bytes of its own regions, point to point (no broadcast).
    Every key of the transfer lives under ``prefix``, a random value of this transfer that travels
    only in this (encrypted, authenticated) message: a process that reaches the store without it
    can neither join the group nor read or replace the addresses its ranks publish there.
    """

    address: str  # host:port of the sender's TCP store
    prefix: str  # the transfer's store keys live under it (megatron_serve.weights.group)
    backend: str
    bucket_bytes: Annotated[int, msgspec.Meta(ge=1)]
    manifest: list[TensorSpec]
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0  # for joining, and for each bucket
    world_size: int | None = None
    rank_offset: int | None = None
    lora: LoraPush | None = None  # the tensors are this adapter version (engine.lora), not base weights
    # A sharded refit (megatron_serve.weights.shards): ``senders`` trainer ranks (0 .. senders - 1) hold these
    # pieces and send each engine rank its own regions point to point; None: rank 0 broadcasts whole tensors.
    pieces: list[PieceSpec] | None = None
    senders: Annotated[int, msgspec.Meta(ge=1)] = 1
    delta: bool = False  # send only the chunks whose digests differ from what each engine rank holds
    # LoRA adapter versions in the same transaction as the policy (megatron_serve.weights.adapters): their tensors
    # are in the manifest as ``adapter/{name}/{PEFT name}``; every engine registers all of them with the policy
    # under its epoch, or none. An engine that ignores this field refuses those names in its verify step.
    adapters: list[LoraPush] | None = None

    def problem(self) -> str | None:
        """Why this rendezvous cannot be used (the coordinator refuses the REFIT with it), or None."""
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            return f"rendezvous address must be host:port, got {self.address!r}"
        if len(self.prefix) < MIN_PREFIX_CHARS:
            return (f"rendezvous prefix must be a random value of at least {MIN_PREFIX_CHARS} characters, "
                    f"got {len(self.prefix)}")
        if self.backend not in TRANSFER_BACKENDS:
            return f"rendezvous backend must be one of {', '.join(TRANSFER_BACKENDS)}, got {self.backend!r}"
        if not self.manifest:
            return "rendezvous manifest is empty: send at least one tensor"
        if self.pieces is None and (self.senders != 1 or self.delta):
            return "rendezvous senders and delta need pieces (a sharded refit)"
        if self.pieces is not None and any(piece.rank >= self.senders for piece in self.pieces):
            return f"rendezvous pieces name a trainer rank outside 0..{self.senders - 1}"
        if self.adapters is not None:
            if self.lora is not None or self.pieces is None:
                return "rendezvous adapters travel only in a sharded policy refit (pieces, no lora)"
            names = [push.name for push in self.adapters]
            if len(set(names)) != len(names):
                return f"rendezvous adapters name an adapter twice: {sorted(names)}"
        for spec in self.manifest:
            if spec.dtype not in TRANSFER_DTYPES:
                return (f"tensor {spec.name!r} has dtype {spec.dtype!r}; weights travel as one of "
                        f"{', '.join(TRANSFER_DTYPES)}")
        return None


class PeerShare(Body):
    """``PEER_WEIGHTS``: engine ``engine_id`` registered after a trainer's refit and pulls the fleet's weights
    (``epoch``) from this engine, which sends them to it through its peer store under ``prefix``, a random value
    that only this message and the joiner's HELLO_ACK carry (:mod:`megatron_serve.weights.peer_pull`)."""

    engine_id: str
    prefix: Annotated[str, msgspec.Meta(min_length=MIN_PREFIX_CHARS)]
    epoch: int
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
