"""An engine's LoRA adapters: the names it serves, which of them sit in the model's slots, and the
slot and prefix-cache root each request runs under.

An adapter is registered under a name (``--lora-modules``, ``/v1/load_lora_adapter``, or the first
request of a ``LoRARequest``), read and checked then; registration keeps its weights in host memory,
at most ``max_cpu_loras`` adapters. The fleet's LOAD_LORA verb reads and checks first (:meth:`EngineLoras.verify`,
which keeps the adapter staged) and registers only once every engine verified (:meth:`EngineLoras.load`
takes the staged copy), so that a refusal anywhere changes nothing everywhere. A request gets a slot of the model's ``max_loras`` when it is
admitted: the adapter's slot when it is in one, else a slot no live request uses (an empty one, or
the adapter there least recently admitted), written from the host copy. When every slot is used by
live requests of other adapters the request fails with that reason (it does not wait yet).

Unloading drops the name only: requests admitted under it keep their slot, whose weights stay until
a later admission takes the slot, which happens only once no live request uses it. Each registration
gets its own prefix-cache root (:func:`adapter_root`), so blocks computed under one adapter are never
found by a request of another, nor by one of a later adapter registered under the same name.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from ..model.config import ModelConfig
from ..model.lora import LoraAdapter, LoraAdapterError, read_adapter
from ..wire.prefix_hash import adapter_root

__all__ = ["EngineLoras", "LoraAdapterError", "adapter_root", "admit_request", "engine_loras", "lora_report",
           "require"]
from ..model.llama import LlamaForCausalLM
from ..model.lora_slots import LoraSlots

if TYPE_CHECKING:
    from ..config import InferenceConfig
    from ..wire.sampling_params import SamplingParams
    from .runner import ModelRunner
    from .scheduler import Sequence


@dataclass
class _Registered:
    adapter: LoraAdapter
    key: str  # unique per registration: the prefix-cache identity of its blocks


class EngineLoras:
    """Registered adapters and the slot table; the engine asks :meth:`admit` for each request's slot."""

    def __init__(self, slots: LoraSlots, config: ModelConfig, max_cpu_loras: int):
        self.slots = slots
        self.model_config = config
        self.max_cpu_loras = max_cpu_loras
        self.registered: dict[str, _Registered] = {}
        self._slot_keys: list[str | None] = [None] * slots.max_loras  # registration held by each slot
        self._last_admitted: list[int] = [0] * slots.max_loras
        self._admissions = itertools.count(1)
        self._registrations = itertools.count(1)
        self._staged: dict[str, tuple[LoraAdapter, float]] = {}  # verified, not registered: (adapter, read seconds)

    def _check_room(self, name: str) -> None:
        if not name:
            raise LoraAdapterError("a LoRA adapter needs a non-empty name")
        if name in self.registered:
            raise LoraAdapterError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        if len(self.registered) >= self.max_cpu_loras:
            raise LoraAdapterError(f"LoRA adapter {name!r}: {len(self.registered)} adapters are loaded, the most "
                                   f"--max-cpu-loras allows; unload one first")

    def verify(self, name: str, path: str) -> float:
        """Read and check ``name`` and keep it staged for :meth:`load`, registering nothing; the seconds the
        read took. Raises :class:`LoraAdapterError` when it cannot be served."""
        self._check_room(name)
        began = time.perf_counter()
        adapter = read_adapter(name, path, self.model_config, self.slots.max_rank)
        seconds = time.perf_counter() - began
        self._staged = {name: (adapter, seconds)}  # only the verb in progress is staged
        return seconds

    def load(self, name: str, path: str) -> float:
        """Register ``name`` (the copy :meth:`verify` staged from the same ``path``, else read now); the seconds
        reading and registering took. Raises :class:`LoraAdapterError` (nothing changed) when it cannot be served."""
        self._check_room(name)
        began = time.perf_counter()
        adapter, seconds = self._staged.pop(name, (None, 0.0))
        if adapter is None or adapter.path != str(Path(path)):
            adapter, seconds = read_adapter(name, path, self.model_config, self.slots.max_rank), 0.0
        self.registered[name] = _Registered(adapter, f"{name}#{next(self._registrations)}")
        return seconds + time.perf_counter() - began

    def unload(self, name: str) -> None:
        if self.registered.pop(name, None) is None:
            raise LoraAdapterError(f"LoRA adapter {name!r} is not loaded")

    def admit(self, name: str, path: str | None, live_slots: set[int]) -> tuple[int, str]:
        """The slot and registration key of a request of adapter ``name`` (registered from ``path`` when new);
        ``live_slots`` are the slots live requests use. Raises :class:`LoraAdapterError` with the reason."""
        if name not in self.registered:
            if path is None:
                raise LoraAdapterError(f"LoRA adapter {name!r} is not loaded")
            self.load(name, path)
        entry = self.registered[name]
        if entry.key in self._slot_keys:
            slot = self._slot_keys.index(entry.key)
        else:
            free = [s for s in range(self.slots.max_loras) if s not in live_slots]
            if not free:
                raise LoraAdapterError(f"LoRA adapter {name!r}: all {self.slots.max_loras} adapter slots "
                                       "(--max-loras) are used by running requests of other adapters")
            slot = min(free, key=lambda s: self._last_admitted[s])
            self.slots.write(slot, entry.adapter)
            self._slot_keys[slot] = entry.key
        self._last_admitted[slot] = next(self._admissions)
        return slot, entry.key

    def names(self) -> dict[str, str]:
        """Registered adapters: name -> path."""
        return {name: entry.adapter.path for name, entry in self.registered.items()}


def engine_loras(model: LlamaForCausalLM, config: "InferenceConfig", runner: "ModelRunner") -> EngineLoras | None:
    """The adapters of an engine with ``enable_lora`` (None without), ``lora_modules`` registered; ``runner``
    fills the slot table's row indices before each forward."""
    if not config.enable_lora:
        return None
    loras = EngineLoras(LoraSlots(model, config.max_loras, config.max_lora_rank), model.config,
                        config.max_cpu_loras or max(config.max_loras, len(config.lora_modules or {})))
    runner.lora_rows = loras.slots.rows
    for name, path in (config.lora_modules or {}).items():
        loras.load(name, path)
    return loras


def require(loras: EngineLoras | None) -> EngineLoras:
    """An engine's adapters; raises :class:`LoraAdapterError` when it was started without ``enable_lora``."""
    if loras is None:
        raise LoraAdapterError("LoRA adapters need an engine started with enable_lora")
    return loras


def admit_request(loras: EngineLoras | None, params: "SamplingParams", live: Iterable["Sequence"]
                  ) -> tuple[int, str | None]:
    """The slot and registration key a request runs under, ``(-1, None)`` for the base model; ``live``: the
    engine's live sequences. Raises :class:`LoraAdapterError` with the reason it cannot run."""
    if params.lora_name is None:
        return -1, None
    return require(loras).admit(params.lora_name, params.lora_path, {s.lora_slot for s in live})


def lora_report(loras: EngineLoras | None, running: Iterable["Sequence"], waiting: Iterable["Sequence"]
                ) -> dict[str, object] | None:
    """What the heartbeat's ``metrics`` says about adapters (vLLM's ``lora_requests_info``): the slots, and the
    adapters of the running and of the waiting requests, by name; None for an engine without ``enable_lora``."""
    if loras is None:
        return None

    def names(sequences: Iterable["Sequence"]) -> list[str]:
        return sorted({n for s in sequences if (n := s.request.sampling_params.lora_name) is not None})

    return {"max_loras": loras.slots.max_loras, "running": names(running), "waiting": names(waiting)}
