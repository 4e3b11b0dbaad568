"""Where a request asks to run: its session (affinity) and a data-parallel rank (a pin), as ``SUBMIT`` carries them.

Both come from the HTTP server (``X-Session-ID`` or a body's ``session_id``, SkyRL's; vLLM's ``X-data-parallel-rank``)
and are read by the coordinator only (:mod:`megatron_serve.coordinator.placement`): engines never see them.
A session is a hint: the coordinator keeps its requests on the engine that holds its KV blocks while that engine is
under its load bound. A rank is a requirement: the request runs on that engine or fails, as vLLM's does. The struct
refuses unknown fields, so a peer that misspells one is told its name instead of being placed anywhere.

``SUBMIT`` carries it from protocol 7 on (:data:`PLACEMENT_PROTOCOL`). A client sends a rank only to a coordinator of 7
or later (an older one would ignore the pin: the client refuses the request instead, naming both versions), and
leaves a session out for an older one (affinity is a hint: the request runs anywhere).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

#: The lowest coordinator version that reads ``SUBMIT``'s ``placement``.
PLACEMENT_PROTOCOL = 7
#: The longest session id accepted (SkyRL's are uuids; a trajectory id with a prefix fits easily).
MAX_SESSION_ID_CHARS = 256


class Placement(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """``session_id``: the multi-turn session the request belongs to; ``data_parallel_rank``: the engine it must run
    on, by its index in the fleet's (engine group, data-parallel rank) order (``coordinator.routing.engine_slot``)."""

    session_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SESSION_ID_CHARS)] | None = None
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0)] | None = None


class PlacementError(ValueError):
    """A placement the coordinator cannot honour (a rank no engine holds): the caller's fault, named as such, so that
    the HTTP server can answer with the header that asked for it."""
