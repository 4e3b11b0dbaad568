"""How long the coordinator waits for each kind of peer before it acts: the deadlines liveness, the verbs and the
handshake's weight pulls read (``megatron-serve coordinator``'s timeout options set them)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HEARTBEAT_TIMEOUT = 10.0
DEFAULT_CLIENT_TIMEOUT = 600.0
# Per verb step. Below the operator's default command timeout (120 s), so that its own call gets the
# acknowledgement even when an engine hangs.
DEFAULT_VERB_TIMEOUT = 60.0
# Steps that move weights (SUSPEND may offload them, RESUME brings them back and captures CUDA graphs,
# REFIT's load reads a checkpoint) take as long as reading a large checkpoint can.
DEFAULT_WEIGHTS_TIMEOUT = 900.0
# An engine's step loop may not move for this long while it has requests. Generous: one step may be a
# long prefill or JIT-compile kernels, and a false alarm moves all the engine's requests elsewhere.
DEFAULT_STALL_TIMEOUT = 120.0


@dataclass(frozen=True)
class Deadlines:
    """Seconds: an engine's silence (``heartbeat``), a client's absence (``client``), a verb step's acknowledgement
    (``verb``; ``weights`` for a step that moves weights), an engine's step loop without progress (``stall``)."""

    heartbeat: float = DEFAULT_HEARTBEAT_TIMEOUT
    client: float = DEFAULT_CLIENT_TIMEOUT
    verb: float = DEFAULT_VERB_TIMEOUT
    weights: float = DEFAULT_WEIGHTS_TIMEOUT
    stall: float = DEFAULT_STALL_TIMEOUT
