"""megatron-serve as a verl rollout backend: ``rollout.name: megatron_serve`` (a replica is one megatron-serve
server, :mod:`.replica`) and ``rollout.checkpoint_engine.backend: megatron_serve`` (the trainer's weights through a
file, then into the server as one REFIT: :mod:`.checkpoint_engine`, :mod:`.adapter`).

Importing this module registers both in verl's registries: verl imports it in every process that needs them through
its plugin entry point (``verl.plugins``, declared by megatron-serve's distribution) or through
``rollout.checkpoint_engine.custom_backend_module: megatron_serve.integrations.verl`` and
``$VERL_USE_EXTERNAL_MODULES``. verl is imported first, so that where it is missing the error names it.
"""

import verl  # noqa: F401 - first: without verl, importing this package fails naming verl

from verl.workers.rollout import base as _rollout_base
from verl.workers.rollout.replica import RolloutReplicaRegistry

from . import checkpoint_engine  # noqa: F401 - registers the "megatron_serve" checkpoint engine

NAME = "megatron_serve"


def _replica() -> type:
    from .replica import MegatronServeReplica  # noqa: PLC0415 - verl loads replica classes when it needs them

    return MegatronServeReplica


RolloutReplicaRegistry.register(NAME, _replica)
# verl's CheckpointEngineWorker builds its server adapter from this table (no register call exists for it).
_rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = "megatron_serve.integrations.verl.adapter.ServerAdapter"
