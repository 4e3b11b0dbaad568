"""The fleet's verbs as bodies: PAUSE, UNPAUSE, SUSPEND, RESUME, STOP, REFIT, LOAD_LORA, UNLOAD_LORA,
RESET_PREFIX_CACHE and SCALE_EP (each a :class:`Control` with its own fields) and their CONTROL_ACK; what the verbs
do and in which order is :mod:`megatron_serve.wire.lifecycle`'s table.
"""

from __future__ import annotations

from typing import Any

from .body import Body, ClientId
from .lifecycle import Verb
from .rendezvous import Rendezvous


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


class ScaleEp(Control):
    """SCALE_EP: the expert-parallel group of data-parallel attention ranks to ``size`` ranks (None: refused)."""

    size: int | None = None


#: Each verb's message, where it has fields of its own (the others travel as a plain :class:`Control`).
VERB_BODIES: dict[Verb, type[Control]] = {
    Verb.PAUSE: Pause,
    Verb.SUSPEND: Suspend,
    Verb.STOP: Stop,
    Verb.REFIT: Refit,
    Verb.LOAD_LORA: LoadLora,
    Verb.UNLOAD_LORA: UnloadLora,
    Verb.RESET_PREFIX_CACHE: ResetPrefixCache,
    Verb.SCALE_EP: ScaleEp,
}


class ControlAck(Body):
    control_id: ClientId
    state: str
    detail: dict[str, Any] | None = None
    engine_id: str | None = None  # from engines
