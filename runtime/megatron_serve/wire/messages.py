"""The coordinator protocol's vocabulary in one place: which body each header carries, each way
(docs/wire-protocol.md).

Each message is one msgpack frame ``[header, body]`` (see :mod:`megatron_serve.wire.protocol`); the body
is a map whose fields are the struct's, so these structs read and write exactly the frames older
peers send and expect. A body is validated once, where it enters the process (types in C by
msgspec, then the struct's own checks), and travels typed from there. Unknown fields are ignored,
so newer peers can add optional fields; absent optional fields are left out of the frame.

Two tables say which bodies each side accepts: :data:`TO_COORDINATOR` (from clients, the operator
and engines) and :data:`FROM_COORDINATOR` (to them). The same header may carry different bodies in
the two directions (``ABORT`` names a client's request id on the way in and the engine-side id on
the way out).

The bodies live by concern, one module each: :mod:`.handshake` (the protocol version, HELLO, ERROR, BATCH),
:mod:`.submission` (a request in, its record out), :mod:`.deltas` (the tokens of each step), :mod:`.controls`
(the verbs), :mod:`.rendezvous` (weights from a trainer or a peer) and :mod:`.status` (STATUS, HEARTBEAT,
KV events), on :mod:`.body`. This module names them all as well: it is the documented place a peer written
in Python imports the protocol from.
"""

from __future__ import annotations

from .body import Body, ClientId, TokenId
from .controls import (VERB_BODIES, Control, ControlAck, LoadLora, Pause, Refit, ResetPrefixCache, ScaleEp, Stop,
                       Suspend, UnloadLora)
from .deltas import (EngineStep, EngineStepOut, PromptScores, RequestDelta, RoutingRows, StepTokens,
                     StepTokensOut, TokenDelta, delta_past)
from .handshake import PROTOCOL_VERSION, SUBMIT_PROTOCOL, Batch, Error, Hello, HelloAck
from .kv_blocks import KVBlocks
from .lifecycle import Verb
from .protocol import VERB_HEADERS, Header
from .rendezvous import (MIN_PREFIX_CHARS, RENDEZVOUS_SCHEME, TRANSFER_BACKENDS, TRANSFER_DTYPES, LoraPush, PeerShare,
                         PieceSpec, Rendezvous, TensorSpec)
from .status import Draining, Heartbeat, KVEvents, Status, StatusReply
from .submission import (ClientAbort, EngineAbort, EngineSubmit, EngineSubmitOut, Handback, Result, ResultAck,
                         ResultOut, Submit, WireImage)

__all__ = [
    "FROM_COORDINATOR", "MIN_PREFIX_CHARS", "PROTOCOL_VERSION", "RENDEZVOUS_SCHEME", "SUBMIT_PROTOCOL",
    "TO_COORDINATOR", "TRANSFER_BACKENDS", "TRANSFER_DTYPES", "Batch", "Body", "ClientAbort", "ClientId", "Control",
    "ControlAck", "Draining", "EngineAbort", "EngineStep", "EngineStepOut", "EngineSubmit", "EngineSubmitOut",
    "Error", "Handback", "Heartbeat", "Hello", "HelloAck", "KVBlocks", "KVEvents", "LoadLora", "LoraPush", "Pause",
    "PeerShare", "PieceSpec", "PromptScores", "Refit", "Rendezvous", "RequestDelta",
    "ResetPrefixCache", "Result", "ResultAck", "ResultOut", "RoutingRows", "ScaleEp", "Status", "StatusReply",
    "StepTokens", "StepTokensOut", "Stop", "Submit", "Suspend", "TensorSpec", "TokenDelta", "TokenId", "UnloadLora",
    "WireImage", "delta_past",
]

#: The verbs, with the same bodies both ways: a client's reaches the coordinator, which passes it on to the engines
#: (PAUSE aside: its mode is the coordinator's work, so engines get a plain :class:`Control`).
_VERBS: dict[Header, type[Body]] = {VERB_HEADERS[verb]: VERB_BODIES.get(verb, Control) for verb in Verb
                                    if verb is not Verb.PAUSE}

#: Bodies the coordinator accepts.
TO_COORDINATOR: dict[Header, type[Body]] = {
    Header.HELLO: Hello,
    Header.BATCH: Batch,
    Header.SUBMIT: Submit,
    Header.ABORT: ClientAbort,
    Header.RESULT_ACK: ResultAck,
    Header.PAUSE: Pause,
    **_VERBS,
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
    **_VERBS,
    Header.HANDBACK: Handback,
    Header.KV_BLOCKS: KVBlocks,
    Header.PEER_WEIGHTS: PeerShare,
}
