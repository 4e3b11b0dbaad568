"""The bodies of the coordinator protocol's messages, as typed structs (docs/wire-protocol.md).

Each message is one msgpack frame ``[header, body]`` (see :mod:`megatron_serve.wire.protocol`); the body
is a map whose fields are the struct's, so these structs read and write exactly the frames older
peers send and expect. A body is validated once, where it enters the process (types in C by
msgspec, then the struct's own checks), and travels typed from there. Unknown fields are ignored,
so newer peers can add optional fields; absent optional fields are left out of the frame.

Two tables say which bodies each side accepts: :data:`TO_COORDINATOR` (from clients, the operator
and engines) and :data:`FROM_COORDINATOR` (to them). The same header may carry different bodies in
the two directions (``ABORT`` names a client's request id on the way in and the engine-side id on
the way out).

Protocol versions (``protocol`` in HELLO and HELLO_ACK; absent means 1): version 2 adds ``BATCH``,
one frame carrying several messages, which a peer sends only to a peer that announced 2. Version 3
adds PAUSE's ``mode`` and ``drain_timeout``: an older coordinator would ignore them (and keep), so a
client asks for a mode other than ``keep`` only of a coordinator that announced 3. Version 4 moves
the text out of engines and coordinator (see :class:`TokenDelta`): engines send token ids only and
a final record without what their deltas carried; the coordinator sends ``TOKENS`` for every
request and ``RESULT`` records without the generated fields, so the client makes the text. A
coordinator refuses ``SUBMIT`` from a client below 4 (its results would have no text), and a
client refuses to submit to a coordinator below 4. Version 5 adds ``STEP_TOKENS``: one message per
engine step and client carrying every one of its requests' deltas (the engine's own bytes, forwarded
with a list of the client's request ids). Version 6 makes it the only token message: ``TOKENS`` (header 11,
a message per request) is retired, and a reconnected client's catch-ups travel as ``STEP_TOKENS`` with
``starts``. Peers submit to each other from 6 on (:data:`SUBMIT_PROTOCOL`): a client below 6 would drop the
catch-ups' ``starts`` and read them as new tokens, and a coordinator below 6 would send ``TOKENS`` this
client no longer reads; each refuses the other with a message naming both versions. Version 7 adds ``SUBMIT``'s
``placement``: a session and a data-parallel rank (:mod:`.placement` says what an older coordinator gets).
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from .kv_blocks import KVBlocks
from .placement import Placement
from .protocol import Header
from .request import WireImage

#: The protocol version this code speaks.
PROTOCOL_VERSION = 7
#: The lowest version whose peers may submit to each other: from 6 on every token travels in ``STEP_TOKENS``
#: (and from 4 on the client makes the text).
SUBMIT_PROTOCOL = 6

TokenId = Annotated[int, msgspec.Meta(ge=0)]
#: Ids that foreign clients chose may be ints; this project always sends strings.
ClientId = Union[str, int]


class Body(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Base of every message body."""


# ----------------------------------------------------------------------------- handshake and errors


class Hello(Body):
    role: str
    proof: str | None = None  # HMAC of the fleet secret and this connection's CURVE key (megatron_serve.wire.security)
    engine_group: Annotated[int, msgspec.Meta(ge=0)] | None = None
    capacity: int | None = None
    client_id: str | None = None  # stable across reconnects, so results find the client again
    acks: bool | None = None  # the client sends RESULT_ACK; keep results until acknowledged
    info: dict[str, Any] | None = None  # facts about the peer (pid, host, KV pool size, model, epoch ...)
    protocol: int = 1


class HelloAck(Body):
    coordinator_id: str
    state: str
    engine_id: str | None = None
    engine_group: int | None = None
    suspend_level: int | None = None
    heartbeat_interval: float | None = None
    refit: dict[str, Any] | None = None  # {source, epoch}: the fleet's current weights, to load before serving
    protocol: int = 1
    tokenizer: str | None = None  # to clients: the directory of the coordinator's tokenizer files
    loras: dict[str, str] | None = None  # to engines: LoRA adapters LOAD_LORA made the fleet serve, to load first


class Error(Body):
    code: str
    message: str
    control_id: ClientId | None = None
    client_request_id: ClientId | None = None
    status_id: ClientId | None = None
    detail: dict[str, Any] | None = None  # a refused verb's facts (e.g. each engine's weights after a failed REFIT)


class Batch(Body):
    """Several messages in one frame (protocol 2): each item is a whole ``[header, body]`` message."""

    messages: list[msgspec.Raw]


# ----------------------------------------------------------------------------- requests


class Submit(Body):
    client_request_id: ClientId
    prompt: str | list[TokenId]
    # Decoded by the coordinator on its own, so that bad values are answered with an ERROR naming the request.
    sampling_params: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET  # absent or nil: the defaults
    stream: bool | None = None
    generated_tokens: list[TokenId] | None = None  # resubmission after a coordinator restart: continue
    images: list[WireImage] | None = None  # one per image placeholder of the prompt, in order
    placement: Placement | None = None  # protocol 7: its session and data-parallel rank (wire.placement)


class Result(Body):
    """The final record of a request; the coordinator forwards the engine's record as it came (``Raw``).

    The record's ``request_id`` is the coordinator's key for the request (``<client id>/<client
    request id>``, the id engines know it by); the client's own id is ``client_request_id``.
    """

    client_request_id: ClientId
    request: msgspec.Raw  # ``wire.request.FinalRecord``, decoded by the client (one it cannot read fails alone)


class ResultOut(Body):
    """:class:`Result` as the coordinator writes it: the record is the engine's msgpack, spliced in unparsed."""

    client_request_id: ClientId
    request: msgspec.Raw


class ClientAbort(Body):
    client_request_id: ClientId


class ResultAck(Body):
    client_request_ids: list[ClientId]


# ----------------------------------------------------------------------------- lifecycle


class Control(Body):
    """PAUSE, UNPAUSE, RESUME (and, with their extra fields, the verbs below)."""

    control_id: ClientId


class Pause(Control):
    """PAUSE from a client (engines get a plain :class:`Control`: the mode is the coordinator's work).

    ``mode`` is checked by the coordinator (an ``ERROR invalid_request`` naming it, never a dropped
    frame); absent means ``keep``.
    """

    mode: str | None = None  # megatron_serve.wire.lifecycle.PauseMode: keep, wait, abort
    drain_timeout: float | None = None  # mode wait: seconds running requests may take before the fleet pauses anyway


class Suspend(Control):
    level: int | None = None
    keep_kv: bool | None = None  # copy live requests' KV to host memory first, and back on RESUME (engine.kv.park)


class Stop(Control):
    drain_timeout: float | None = None


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


class Refit(Control):
    source: str  # a model directory, or (with ``rendezvous``) the sender's label, ``rendezvous://host:port``
    epoch: int | None = None
    phase: str | None = None  # to engines: which step (see megatron_serve.wire.lifecycle.STEPS)
    rendezvous: Rendezvous | None = None  # the weights come from a trainer over a collective


class LoadLora(Control):
    """LOAD_LORA: serve the PEFT adapter in directory ``lora_path`` (as the engines see it) as ``lora_name``."""

    lora_name: str
    lora_path: str
    phase: str | None = None  # to engines: which step (see megatron_serve.wire.lifecycle.STEPS)


class UnloadLora(Control):
    """UNLOAD_LORA: stop serving ``lora_name`` to new requests."""

    lora_name: str


class ResetPrefixCache(Control):
    """RESET_PREFIX_CACHE: forget every cached prefix block; ``reset_running_requests`` sends the running requests
    back to be recomputed first (without it, an engine whose requests hold blocks does not reset)."""

    reset_running_requests: bool | None = None


class ControlAck(Body):
    control_id: ClientId
    state: str
    detail: dict[str, Any] | None = None
    engine_id: str | None = None  # from engines


# ----------------------------------------------------------------------------- status and liveness


class Status(Body):
    status_id: ClientId | None = None


class StatusReply(Body):
    state: str
    engines: list[dict[str, Any]]
    queued: int
    in_flight: int
    completed: int
    failed: int
    aborted: int | None = None  # not counted in failed; absent from older coordinators
    status_id: ClientId | None = None
    epoch: int | None = None  # generation of the weights the fleet serves (bumped by REFIT)
    coordinator_id: str | None = None
    routing: str | None = None
    suspend_level: int | None = None
    clients: int | None = None
    pending_controls: list[str] | None = None
    dropped_frames: int | None = None
    weights: str | None = None
    refits: int | None = None
    epoch_mismatch: list[str] | None = None
    incomplete_weights: list[str] | None = None  # engines left with a mix by a failed refit (UNPAUSE refused)
    stall_timeout: float | None = None  # an engine whose ``stalled_s`` passes it is removed as unresponsive
    sessions: dict[str, Any] | None = None  # session affinity: sessions known, requests kept and moved, the TTL


class Heartbeat(Body):
    """Both ways: a peer's liveness (engines add their load), the coordinator's answer (its state)."""

    engine_id: str | None = None
    state: str | None = None
    running: int | None = None
    waiting: int | None = None
    kv_blocks_free: int | None = None
    kv_blocks_total: int | None = None
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    stats: dict[str, Any] | None = None
    # iterations of the engine's step loop; absent from older engines (unknown, never "stalled")
    progress: int | None = None
    # cumulative engine counters and histogram buckets (engine_stats.EngineStats.to_wire); optional
    metrics: dict[str, Any] | None = None
    coordinator_id: str | None = None


class Draining(Body):
    engine_id: str | None = None


# ----------------------------------------------------------------------------- engine link


class EngineSubmit(Body):
    """A request for an engine: ``wire.request.EngineRequest``, decoded by the engine on its own (so that one it
    cannot read fails alone, by its id)."""

    request: msgspec.Raw
    # vLLM's: {"do_remote_decode": true} to a prefill engine, {"do_remote_prefill": true, ...} to a decode engine
    # (after the request's KV_BLOCKS: wire.kv_blocks)
    kv_transfer_params: dict[str, Any] | None = None


class EngineSubmitOut(Body):
    """:class:`EngineSubmit` as the coordinator writes it (a ``wire.request.EngineRequestOut``)."""

    request: Any
    kv_transfer_params: dict[str, Any] | None = None


class RoutingRows(Body):
    """Routing replay: the expert-routing rows of a request's positions ``start, start + 1, ...``
    (``expert_routing``: ``shape`` [rows, MoE layers, top_k], ``dtype`` uint8/uint16, ``data`` the raw ids)."""

    start: Annotated[int, msgspec.Meta(ge=0)]
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    dtype: str
    data: bytes


class PromptScores(Body):
    """``return_prompt_log_probs``: the log probs of prompt tokens 1.. and, with ``top_n_logprobs``, the
    n most likely tokens at each of those positions, as parallel lists."""

    log_probs: list[float]
    top_ids: list[list[int]] | None = None
    top_log_probs: list[list[float]] | None = None


class TokenDelta(Body):
    """What one engine step added to one request: its new token ids and, when asked, what goes with them.

    Only ids travel: the text is made where it is read (the client side,
    :mod:`megatron_serve.client.output_processor`), which keeps detokenization and stop strings off the
    engine's step thread. Top-n log probs are parallel lists (``top_ids[i]`` and
    ``top_log_probs[i]`` for new token ``i``), not a map per token.
    """

    new_tokens: list[TokenId]
    new_log_probs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_log_probs: list[list[float]] | None = None
    epochs: list[list[int]] | None = None  # [policy epochs, KV epochs, LoRA adapter versions] of the new tokens
    routing: RoutingRows | None = None  # return_routing_indices: the rows processed since the last delta
    # With the request's first tokens (an engine that stops at the first token sends them with none):
    cached_tokens: int | None = None  # prompt tokens its engine found in the prefix cache
    prompt_scores: PromptScores | None = None  # return_prompt_log_probs
    # The last of new_tokens is the stop id that ended the request (EOS or stop_token_ids): it stays in the ids,
    # counted and with its log prob, and the text is made without it unless include_stop_str_in_output (vLLM's)
    stop_token: bool = False


class RequestDelta(TokenDelta, kw_only=True):
    """One request's share of an engine step; the final one carries the record's remaining fields.

    (Not the engine's ``megatron_serve.engine.StepOutput``, the in-process result this is built from.)"""

    request_id: str
    finished: bool
    # When finished: the record without what already travelled in deltas (the receivers accumulate them;
    # ``wire.request.FinalRecord``). Maybe nil.
    request: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class RequestDeltaOut(RequestDelta, kw_only=True):
    """:class:`RequestDelta` as an engine writes it (its final record, a ``wire.request.FinalRecord``, encoded
    with the step; typed ``Any`` here because that module builds on this one)."""

    request: Any = msgspec.UNSET


class EngineStep(Body):
    engine_id: str
    # Each item decoded on its own, so that one unreadable output does not lose the others.
    outputs: list[msgspec.Raw]


class EngineStepOut(Body):
    """:class:`EngineStep` as an engine writes it: every request's delta of one step, one message."""

    engine_id: str
    outputs: list[RequestDeltaOut]


class StepTokens(Body):
    """The token message (protocol 6: the only one): the deltas one engine step made for the requests of one client,
    ``deltas[i]`` for its request ``client_request_ids[i]``.

    The coordinator forwards each delta as the engine encoded it (a ``RequestDelta``, whose engine-side fields
    a client ignores) and only decodes it to keep its mirror of the request's tokens: no message to build
    and encode per request and step.

    ``starts`` is set on catch-ups only (what a reconnected or resubmitting client lacked, from the coordinator's
    mirror): ``starts[i]`` is the index of ``deltas[i]``'s first token in its request's generated tokens. The count
    the coordinator went by is old by the time the catch-up arrives (the steps it forwarded since reach the client
    first, and the catch-up repeats them), so the client keeps only what lies past the tokens it has
    (:func:`delta_past`).
    """

    client_request_ids: list[ClientId]
    deltas: list[TokenDelta]
    starts: list[Annotated[int, msgspec.Meta(ge=0)]] | None = None

    def __post_init__(self) -> None:
        if len(self.client_request_ids) != len(self.deltas):
            raise ValueError(f"{len(self.client_request_ids)} client_request_ids for {len(self.deltas)} deltas")
        if self.starts is not None and len(self.starts) != len(self.deltas):
            raise ValueError(f"{len(self.starts)} starts for {len(self.deltas)} deltas")


def delta_past(delta: TokenDelta, start: int, have: int) -> TokenDelta | None:
    """A catch-up ``delta`` whose first token is generated token ``start``, without the tokens before index ``have``
    (a client's count when it arrives); None when it brings nothing new. Per-token lists end with the tokens (they
    may cover only the last ones: a resubmission's own tokens came without them) and are cut alike."""
    if have <= start:
        return delta
    drop = have - start
    count = len(delta.new_tokens)
    if drop >= count:
        return None

    def cut(values: list[Any]) -> list[Any]:
        return values[max(drop - (count - len(values)), 0):]

    def cut_some(values: list[Any] | None) -> list[Any] | None:
        return None if values is None else cut(values)

    epochs = None if delta.epochs is None else [cut(e) for e in delta.epochs]
    return msgspec.structs.replace(delta, new_tokens=delta.new_tokens[drop:], epochs=epochs,
                                   new_log_probs=cut_some(delta.new_log_probs), top_ids=cut_some(delta.top_ids),
                                   top_log_probs=cut_some(delta.top_log_probs))


class StepTokensOut(Body):
    """:class:`StepTokens` as the coordinator writes it: the engine's deltas spliced in as they came."""

    client_request_ids: list[ClientId]
    deltas: list[msgspec.Raw]
    starts: list[int] | None = None


class EngineAbort(Body):
    request_id: str


class Handback(Body):
    request_ids: list[Any]
    engine_id: str | None = None  # from engines; absent in the coordinator's acknowledgement
    final: bool | None = None


class PeerShare(Body):
    """``PEER_WEIGHTS``: engine ``engine_id`` registered after a trainer's refit and pulls the fleet's weights
    (``epoch``) from this engine, which sends them to it through its peer store under ``prefix``, a random value
    that only this message and the joiner's HELLO_ACK carry (:mod:`megatron_serve.weights.peer_pull`)."""

    engine_id: str
    prefix: Annotated[str, msgspec.Meta(min_length=MIN_PREFIX_CHARS)]
    epoch: int
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0


class KVEvents(Body):
    """``KV_EVENTS``: batch ``seq`` of an engine's KV events (:mod:`megatron_serve.wire.kv_events`), its bytes as the
    engine's ZeroMQ publisher sends them; a registration's first batch starts with ``AllBlocksCleared`` and holds
    every block the engine holds then (the coordinator's index starts whole)."""

    engine_id: str
    seq: Annotated[int, msgspec.Meta(ge=0)]
    batch: msgspec.Raw


#: Bodies the coordinator accepts.
TO_COORDINATOR: dict[Header, type[Body]] = {
    Header.HELLO: Hello,
    Header.BATCH: Batch,
    Header.SUBMIT: Submit,
    Header.ABORT: ClientAbort,
    Header.RESULT_ACK: ResultAck,
    Header.PAUSE: Pause,
    Header.UNPAUSE: Control,
    Header.SUSPEND: Suspend,
    Header.RESUME: Control,
    Header.STOP: Stop,
    Header.REFIT: Refit,
    Header.LOAD_LORA: LoadLora,
    Header.UNLOAD_LORA: UnloadLora,
    Header.RESET_PREFIX_CACHE: ResetPrefixCache,
    Header.STATUS: Status,
    Header.HEARTBEAT: Heartbeat,
    Header.DRAINING: Draining,
    Header.CONTROL_ACK: ControlAck,
    Header.ENGINE_STEP: EngineStep,
    Header.HANDBACK: Handback,
    Header.KV_BLOCKS: KVBlocks,
    Header.KV_EVENTS: KVEvents,
}

#: Bodies engines and clients accept from the coordinator.
FROM_COORDINATOR: dict[Header, type[Body]] = {
    Header.HELLO_ACK: HelloAck,
    Header.BATCH: Batch,
    Header.ERROR: Error,
    Header.STEP_TOKENS: StepTokens,
    Header.RESULT: Result,
    Header.CONTROL_ACK: ControlAck,
    Header.STATUS_REPLY: StatusReply,
    Header.HEARTBEAT: Heartbeat,
    Header.ENGINE_SUBMIT: EngineSubmit,
    Header.ABORT: EngineAbort,
    Header.PAUSE: Control,
    Header.UNPAUSE: Control,
    Header.SUSPEND: Suspend,
    Header.RESUME: Control,
    Header.STOP: Stop,
    Header.REFIT: Refit,
    Header.LOAD_LORA: LoadLora,
    Header.UNLOAD_LORA: UnloadLora,
    Header.RESET_PREFIX_CACHE: ResetPrefixCache,
    Header.HANDBACK: Handback,
    Header.KV_BLOCKS: KVBlocks,
    Header.PEER_WEIGHTS: PeerShare,
}
