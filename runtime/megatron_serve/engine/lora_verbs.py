"""The engine's adapter verbs (LOAD_LORA / UNLOAD_LORA and their verify).

Mixed into :class:`~.core.DynamicInferenceEngine` beside :class:`~.memory_verbs.DeviceMemoryVerbs`: they run
between steps and only touch :mod:`.lora`'s registry and the engine's statistics, so the step loop's module
keeps to the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lora import require

if TYPE_CHECKING:
    from ..wire.engine_stats import EngineStats
    from .lora import EngineLoras


class LoraVerbs:
    """Mixed into :class:`~.core.DynamicInferenceEngine`, whose ``loras`` and ``stats`` these methods use."""

    loras: "EngineLoras | None"
    stats: "EngineStats"

    def verify_lora_adapter(self, name: str, path: str) -> float:
        """Read and check the adapter at ``path`` for ``name`` without serving it (the fleet's LOAD_LORA verifies on
        every engine first); the seconds the read took. Raises ``LoraAdapterError`` with the reason."""
        return require(self.loras).verify(name, path)

    def load_lora_adapter(self, name: str, path: str) -> float:
        """Serve the PEFT adapter at ``path`` as ``name`` from the next request on (engine.lora); a bad adapter
        raises :class:`~megatron_serve.model.lora.LoraAdapterError` and changes nothing. Returns the seconds the
        load took (the verify's read included), observed in ``lora_adapter_load_seconds``."""
        seconds = require(self.loras).load(name, path)
        self.stats.histograms["lora_adapter_load_seconds"].observe(seconds)
        return seconds

    def lora_adapters(self) -> dict[str, str] | None:
        """The adapters served by name (name -> directory); None for an engine without ``enable_lora``."""
        return None if self.loras is None else self.loras.names()

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name``: later requests naming it fail; requests admitted under it finish under it."""
        require(self.loras).unload(name)
