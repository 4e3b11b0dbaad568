"""The coordinator: one process per deployment that owns routing, the request table and the lifecycle.

Engines and clients connect DEALER sockets to the coordinator's ROUTER (docs/architecture.md, docs/wire-protocol.md).
The package is split by the question a reader has:

* :mod:`.core` -- all state and decisions, no sockets: inputs in, effects out (:mod:`.effects`), held in named parts:
  :mod:`.membership` (who is connected), :mod:`.lifecycle` (the fleet's state), :mod:`.fleet_weights`,
  :mod:`.deadlines`; each module below is handed the parts it works on (none of them imports the core);
* :mod:`.handshake` -- HELLO and its proof of the fleet secret, engine groups and client ids;
* :mod:`.flow` and :mod:`.requests` -- every request's way, the request table and its phases;
* :mod:`.dispatch` -- which engine gets the next queued request (:mod:`.candidates`: those that may, by load);
* :mod:`.verbs` -- the lifecycle state machine at work (its rules: :mod:`megatron_serve.wire.lifecycle`);
* :mod:`.liveness` -- heartbeats, verb-step deadlines, stalled step loops, departed clients;
* :mod:`.loop` -- the socket loop that performs the effects.
"""

from .core import CoordinatorCore
from .deadlines import (
    DEFAULT_CLIENT_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_STALL_TIMEOUT,
    DEFAULT_VERB_TIMEOUT,
    DEFAULT_WEIGHTS_TIMEOUT,
)
from .loop import Coordinator, InsecureRefused, check_secret, serve, write_address_file

__all__ = ["Coordinator", "CoordinatorCore", "InsecureRefused", "check_secret", "serve", "write_address_file",
           "DEFAULT_CLIENT_TIMEOUT", "DEFAULT_HEARTBEAT_TIMEOUT", "DEFAULT_STALL_TIMEOUT", "DEFAULT_VERB_TIMEOUT",
           "DEFAULT_WEIGHTS_TIMEOUT"]
