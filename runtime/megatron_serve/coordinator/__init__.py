"""The coordinator: one process per deployment that owns routing, the request table and the lifecycle.

Engines and clients connect DEALER sockets to the coordinator's ROUTER (docs/architecture.md, docs/wire-protocol.md).
The package is split by the question a reader has:

* :mod:`.core` -- all state and decisions, no sockets: inputs in, effects out (:mod:`.effects`);
* :mod:`.core_view` -- the core as the modules below see it (a Protocol: none of them imports the core);
* :mod:`.handshake` -- HELLO and its proof of the fleet secret, engine groups and client ids;
* :mod:`.requests` -- the request table and its phases;
* :mod:`.dispatch` -- which engine gets the next queued request;
* :mod:`.verbs` -- the lifecycle state machine at work (its rules: :mod:`megatron_serve.wire.lifecycle`);
* :mod:`.liveness` -- heartbeats, verb-step deadlines, stalled step loops, departed clients;
* :mod:`.loop` -- the socket loop that performs the effects.
"""

from .core import (
    DEFAULT_CLIENT_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_STALL_TIMEOUT,
    DEFAULT_VERB_TIMEOUT,
    DEFAULT_WEIGHTS_TIMEOUT,
    CoordinatorCore,
)
from .loop import Coordinator, InsecureRefused, check_secret, serve, write_address_file

__all__ = ["Coordinator", "CoordinatorCore", "InsecureRefused", "check_secret", "serve", "write_address_file",
           "DEFAULT_CLIENT_TIMEOUT", "DEFAULT_HEARTBEAT_TIMEOUT", "DEFAULT_STALL_TIMEOUT", "DEFAULT_VERB_TIMEOUT",
           "DEFAULT_WEIGHTS_TIMEOUT"]
