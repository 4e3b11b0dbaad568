"""The engine's adapter verbs (LOAD_LORA / UNLOAD_LORA and their verify) as one object the engine holds.

They run between steps and only touch :mod:`.lora`'s registry and the engine's statistics, so the step loop's module
keeps to the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .adapters import require

if TYPE_CHECKING:
    from ...wire.engine_stats import EngineStats
    from .adapters import EngineLoras


class Adapters:
    """The adapter verbs over the engine's adapter registry (``loras``: None without ``enable_lora``, when every
    verb but :meth:`names` raises ``LoraAdapterError`` saying so)."""

    def __init__(self, loras: EngineLoras | None, stats: EngineStats):
        self.loras = loras
        self.stats = stats

    def verify(self, name: str, path: str) -> float:
        """Read and check the adapter at ``path`` for ``name`` without serving it (the fleet's LOAD_LORA verifies on
        every engine first); the seconds the read took. Raises ``LoraAdapterError`` with the reason."""
        return require(self.loras).verify(name, path)

    def load(self, name: str, path: str) -> float:
        """Serve the PEFT adapter at ``path`` as ``name`` from the next request on (engine.lora); a bad adapter
        raises :class:`~megatron_serve.model.lora.checkpoint.LoraAdapterError` and changes nothing. Returns the seconds the
        load took (the verify's read included), observed in ``lora_adapter_load_seconds``."""
        seconds = require(self.loras).load(name, path)
        self.stats.histograms["lora_adapter_load_seconds"].observe(seconds)
        return seconds

    def names(self) -> dict[str, str] | None:
        """The adapters served by name (name -> directory); None for an engine without ``enable_lora``."""
        return None if self.loras is None else self.loras.names()

    def unload(self, name: str) -> None:
        """Stop serving ``name``: later requests naming it fail; requests admitted under it finish under it."""
        require(self.loras).unload(name)
