"""An engine's LoRA adapters: the names it serves, which of them sit in the model's slots, and the
slot and prefix-cache root each request runs under.

An adapter is registered under a name (``--lora-modules``, ``/v1/load_lora_adapter``, or the first
request of a ``LoRARequest``), read and checked then; host memory keeps the weights of at most ``max_cpu_loras``
adapters, least recently used ones leaving it (their names stay registered; a request naming one reads it again
from its directory). The names follow :mod:`..wire.lora_names`, and the fleet's LOAD_LORA reads only under
``lora_allowed_dirs``. The fleet's LOAD_LORA verb reads and checks first (:meth:`EngineLoras.verify`,
which keeps the adapter staged) and registers only once every engine verified (:meth:`EngineLoras.load`
takes the staged copy), so that a refusal anywhere changes nothing everywhere. A request gets a slot of the model's ``max_loras`` when it is
admitted: the adapter's slot when it is in one, else a slot no live request uses (an empty one, or
the adapter there least recently admitted), written from the host copy. When every slot is used by
live requests of other adapters the request waits (:mod:`.lora_queue`) until one is free.

Unloading drops the name only: requests admitted under it keep their slot, whose weights stay until
a later admission takes the slot, which happens only once no live request uses it. Each registration
gets its own prefix-cache root (:func:`adapter_root`), so blocks computed under one adapter are never
found by a request of another, nor by one of a later adapter registered under the same name.

Versions (RL, :meth:`EngineLoras.push`): a trainer's push registers version N of a name from tensors,
no disk. It is a registration like any other: new requests get the newest version, while requests
admitted under an older one keep its slot, so they finish under the weights they started with. A
version stays resident while it is the newest or a live request uses its slot; at most
``max_versions`` (``--max-lora-versions``) versions of a name may be resident, so a push that would
make one more is refused until the older requests finish. A directory's adapter is version 0.

Tensor parallelism: adapters live in rank 0's host memory; a slot write is sent to the other ranks first
(``on_write``), each of which keeps its share (:mod:`..model.lora_shards`).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from ...model.config import ModelConfig
from ...model.lora.checkpoint import (LoraAdapter, LoraAdapterError, adapter_experts, adapter_of, adapter_scaling,
                                      check_shapes, read_adapter)
from ...wire.lora_names import name_problem, path_problem, shown
from ...wire.rendezvous import LoraPush
from ...wire.prefix_hash import adapter_root

__all__ = ["EngineLoras", "LoraAdapterError", "Registration", "adapter_root", "admit_request", "engine_loras",
           "lora_report", "require"]
from ...model.llama import LlamaForCausalLM
from ...model.lora.slots import LoraSlots
from .graphs import add_lora_graphs
from .store import save_pushed, stored_version

logger = logging.getLogger("megatron_serve.engine")

if TYPE_CHECKING:
    import torch

    from ...config import InferenceConfig
    from ...wire.sampling_params import SamplingParams
    from ..runner import ModelRunner
    from ..sequence import Sequence


@dataclass
class Registration:
    """An adapter as registered under its name; a request runs under the one it was admitted with."""

    adapter: LoraAdapter
    key: str  # unique per registration: the prefix-cache identity of its blocks
    version: int = 0  # a trainer's push numbers them; a directory's adapter is 0
    reloadable: bool = True  # read from adapter.path (a push without --lora-push-dir has no directory to read again)


class EngineLoras:
    """Registered adapters and the slot table; the engine asks :meth:`admit` for each request's slot.

    Host memory holds at most ``max_cpu_loras`` adapters (``resident``, least recently used first); registering
    one more evicts the least recently used adapter that can be read again from its directory, whose name stays
    registered (``evicted``: name -> (path, version)) and is read again when a request names it, as vLLM's
    LRU cache of CPU LoRAs does. A pushed version without a directory is never evicted."""

    def __init__(self, slots: LoraSlots, config: ModelConfig, max_cpu_loras: int, max_versions: int = 2,
                 allowed_dirs: Iterable[str] = ()):
        self.slots = slots
        self.model_config = config
        self.max_cpu_loras = max_cpu_loras
        self.max_versions = max_versions
        self.allowed_dirs = tuple(os.path.realpath(d) for d in allowed_dirs)  # where LOAD_LORA may read
        self.resident: dict[str, Registration] = {}  # in order of use, least recent first
        self.evicted: dict[str, tuple[str, int]] = {}
        self._slot_keys: list[str | None] = [None] * slots.max_loras  # registration held by each slot
        self._slot_versions: list[tuple[str, int] | None] = [None] * slots.max_loras  # (name, version) in each
        self._last_admitted: list[int] = [0] * slots.max_loras
        self._admissions = itertools.count(1)
        self._registrations = itertools.count(1)
        self._staged: dict[str, tuple[LoraAdapter, float]] = {}  # verified, not registered: (adapter, read seconds)
        self.push_dir: str | None = None  # --lora-push-dir: pushed versions are written there (.lora_store)
        # called with (slot, adapter) before a slot is written here: a TP group's rank 0 sends it to the other ranks
        self.on_write: Callable[[int, LoraAdapter], None] | None = None

    def _check_new(self, name: str) -> None:
        problem = name_problem(name)
        if problem is not None:
            raise LoraAdapterError(problem)
        if name in self.resident or name in self.evicted:
            raise LoraAdapterError(f"LoRA adapter {name!r} is already loaded (unload it first)")

    def _evictable(self) -> str | None:
        """The least recently used adapter whose host copy may be dropped (read again from its directory)."""
        return next((name for name, entry in self.resident.items() if entry.reloadable), None)

    def _check_room(self, name: str) -> None:
        """Raise unless one more adapter fits in host memory, evicting one if needed."""
        if len(self.resident) >= self.max_cpu_loras and self._evictable() is None:
            raise LoraAdapterError(f"LoRA adapter {name!r}: the {len(self.resident)} adapters in host memory "
                                   f"(--max-cpu-loras) are pushed versions with no directory to read them again "
                                   "from; unload one first (or push with --lora-push-dir)")

    def _register(self, entry: Registration) -> Registration:
        """Make ``entry`` the adapter of its name, evicting least recently used ones beyond ``max_cpu_loras``."""
        name = entry.adapter.name
        self.resident.pop(name, None)
        self.evicted.pop(name, None)
        while len(self.resident) >= self.max_cpu_loras:
            victim = self._evictable()
            if victim is None:
                break  # _check_room refused this case before anything changed
            dropped = self.resident.pop(victim)
            self.evicted[victim] = (dropped.adapter.path, dropped.version)
            logger.info("LoRA adapter %s left host memory (--max-cpu-loras %d); read again from %s when a request "
                        "names it", shown(victim), self.max_cpu_loras, shown(dropped.adapter.path))
        self.resident[name] = entry
        return entry

    def check_allowed(self, name: str, path: str) -> None:
        """Raise unless ``path`` lies in a directory of ``--lora-allowed-dirs``; the answer is the same whether
        or not it exists, so the refusal tells nothing about places outside them."""
        problem = path_problem(name, path)
        if problem is not None:
            raise LoraAdapterError(problem)
        real = os.path.realpath(path)
        if not any(real == d or real.startswith(d.rstrip(os.sep) + os.sep) for d in self.allowed_dirs):
            where = ", ".join(shown(d) for d in self.allowed_dirs) or "none (no --lora-modules)"
            raise LoraAdapterError(f"LoRA adapter {name!r}: path {shown(path)} is not allowed: runtime loads read "
                                   f"only under --lora-allowed-dirs ({where})")

    def _read(self, name: str, path: str) -> LoraAdapter:
        problem = path_problem(name, path)
        if problem is not None:
            raise LoraAdapterError(problem)
        adapter = read_adapter(name, path, self.model_config, self.slots.max_rank)
        self.slots.check(adapter)
        return adapter

    def verify(self, name: str, path: str) -> float:
        """Read and check ``name`` for the fleet's LOAD_LORA (``path`` within ``--lora-allowed-dirs``) and keep it
        staged for :meth:`load`, registering nothing; the seconds the read took. Raises
        :class:`LoraAdapterError` when it cannot be served."""
        self._check_new(name)
        self.check_allowed(name, path)
        began = time.perf_counter()
        adapter = self._read(name, path)
        self._check_room(name)
        seconds = time.perf_counter() - began
        self._staged = {name: (adapter, seconds)}  # only the verb in progress is staged
        return seconds

    def load(self, name: str, path: str) -> float:
        """Register ``name`` (the copy :meth:`verify` staged from the same ``path``, else read now); the seconds
        reading and registering took. Raises :class:`LoraAdapterError` (nothing changed) when it cannot be served."""
        self._check_new(name)
        began = time.perf_counter()
        adapter, seconds = self._staged.pop(name, (None, 0.0))
        if adapter is None or adapter.path != str(Path(path)):
            adapter, seconds = self._read(name, path), 0.0
        self._check_room(name)
        self._register(Registration(adapter, f"{name}#{next(self._registrations)}", stored_version(path)))
        return seconds + time.perf_counter() - began

    def check_push(self, push: LoraPush, shapes: Iterable[tuple[str, tuple[int, ...]]], live_slots: set[int]) -> float:
        """Check that ``push`` with tensors of these PEFT names and shapes can become the newest version of its
        name (reads no data); returns its scaling. Raises :class:`LoraAdapterError` naming the problem."""
        name = push.name
        problem = name_problem(name)
        if problem is not None:
            raise LoraAdapterError(problem)
        scaling = adapter_scaling(name, push.rank, push.alpha, push.use_rslora, push.target_modules,
                                  self.slots.max_rank)
        check_shapes(name, shapes, self.model_config, push.rank, push.target_modules,
                     adapter_experts(name, push.target_parameters))
        current = self.resident.get(name)
        served = current.version if current is not None else self.evicted.get(name, ("", None))[1]
        if current is None:
            self._check_room(name)
        if served is not None and push.version <= served:
            raise LoraAdapterError(f"LoRA adapter {name!r}: version {push.version} is not newer than the served "
                                   f"version {served}")
        running = self.running_versions(name, live_slots)
        if len(running) + 1 > self.max_versions:
            raise LoraAdapterError(f"LoRA adapter {name!r}: running requests use versions {running}; with version "
                                   f"{push.version} that makes {len(running) + 1} resident versions, above "
                                   f"--max-lora-versions {self.max_versions} (push again once they finish)")
        return scaling

    def push(self, push: LoraPush, named: Iterable[tuple[str, "torch.Tensor"]], live_slots: set[int]) -> None:
        """Register ``named`` (PEFT names) as version ``push.version`` of ``push.name``, the one new requests get;
        requests admitted under an older version keep it. Nothing changes when it raises."""
        self.register(self.prepare(push, named, live_slots))

    def prepare(self, push: LoraPush, named: Iterable[tuple[str, "torch.Tensor"]], live_slots: set[int]
                ) -> Registration:
        """Build (and with ``--lora-push-dir`` store) version ``push.version`` of ``push.name`` from ``named``
        without serving it: a refit builds every adapter it carries before it changes any weight, and registers
        them (:meth:`register`) once the policy loaded. Raises :class:`LoraAdapterError`, nothing registered."""
        tensors = list(named)
        scaling = self.check_push(push, ((key, tuple(t.shape)) for key, t in tensors), live_slots)
        adapter = adapter_of(push.name, f"{push.name}@{push.version}", push.rank, scaling, tensors, self.model_config,
                             adapter_experts(push.name, push.target_parameters))  # checked finite, too
        self.slots.check(adapter)
        if self.push_dir is not None:  # engines that join later load it from there (the coordinator tells them)
            adapter = replace(adapter, path=save_pushed(self.push_dir, push, tensors))
        return Registration(adapter, f"{push.name}#{next(self._registrations)}", push.version,
                            reloadable=self.push_dir is not None)

    def register(self, entry: Registration) -> None:
        """Serve a version :meth:`prepare` built: new requests of its name get it."""
        self._register(entry)

    def running_versions(self, name: str, live_slots: set[int]) -> list[int]:
        """The versions of ``name`` that live requests run under (their slots), ascending."""
        return sorted({owner[1] for slot, owner in enumerate(self._slot_versions)
                       if owner is not None and owner[0] == name and slot in live_slots})

    def unload(self, name: str) -> None:
        if self.resident.pop(name, None) is None and self.evicted.pop(name, None) is None:
            raise LoraAdapterError(f"LoRA adapter {name!r} is not loaded")

    def resolve(self, name: str, path: str | None) -> Registration:
        """The registration a request of ``name`` runs under (registered from ``path`` when new, read again from
        its directory when it left host memory); a request keeps it while it waits for a slot, so an unload or a
        push meanwhile does not change what it runs. Raises :class:`LoraAdapterError` with the reason it cannot
        run."""
        entry = self.resident.pop(name, None)
        if entry is not None:
            self.resident[name] = entry  # the most recently used now
            return entry
        if name in self.evicted:
            where, version = self.evicted[name]
            self._check_room(name)
            return self._register(Registration(self._read(name, where), f"{name}#{next(self._registrations)}",
                                               version))
        if path is None:
            raise LoraAdapterError(f"LoRA adapter {name!r} is not loaded")
        self.load(name, path)
        return self.resident[name]

    def place(self, entry: Registration, live_slots: set[int], share_only: bool = False,
              closed: int | None = None) -> int | None:
        """The slot of a request of registration ``entry`` (written now when it holds another), or None while every
        slot is used by live requests (``live_slots``) of other registrations: the request then waits
        (:mod:`.lora_queue`). ``share_only``: only the slot that holds ``entry`` already, never slot ``closed``."""
        if entry.key in self._slot_keys:
            slot = self._slot_keys.index(entry.key)
            if share_only and slot == closed:
                return None
        elif share_only:
            return None
        else:
            free = [s for s in range(self.slots.max_loras) if s not in live_slots]
            if not free:
                return None
            slot = min(free, key=lambda s: self._last_admitted[s])
            if self.on_write is not None:
                self.on_write(slot, entry.adapter)
            self.slots.write(slot, entry.adapter)
            self._slot_keys[slot] = entry.key
            self._slot_versions[slot] = (entry.adapter.name, entry.version)
        self._last_admitted[slot] = next(self._admissions)
        return slot

    def holder(self, slot: int) -> str | None:
        """The registration whose weights are in ``slot`` (its key), None for a slot never written."""
        return self._slot_keys[slot]

    def drain_choice(self, live: dict[int, int]) -> int:
        """The slot to drain for a waiting request, of ``live`` (slot -> its live requests): the one with the fewest
        requests to finish, the least recently admitted among equals."""
        return min(live, key=lambda slot: (live[slot], self._last_admitted[slot]))

    def names(self) -> dict[str, str]:
        """Registered adapters, in host memory or not: name -> path."""
        return {**{name: path for name, (path, _) in self.evicted.items()},
                **{name: entry.adapter.path for name, entry in self.resident.items()}}


def engine_loras(model: LlamaForCausalLM, config: "InferenceConfig", runner: "ModelRunner",
                 kv_caches: list[tuple["torch.Tensor", "torch.Tensor"]] | None = None) -> EngineLoras | None:
    """The adapters of an engine with ``enable_lora`` (None without), ``lora_modules`` registered; ``runner``
    fills the slot table's row indices before each forward, and gets decode graphs for steps with adapter rows
    over ``kv_caches`` (:mod:`.lora_graphs`) where its graphs can hold them."""
    if not config.enable_lora:
        return None
    slots = LoraSlots(model, config.max_loras, config.max_lora_rank, config.batch_invariant)
    loras = EngineLoras(slots, model.config, config.max_cpu_loras or max(config.max_loras, len(config.lora_modules or {})),
                        config.max_lora_versions, allowed_lora_dirs(config))
    runner.lora_rows = loras.slots.rows
    loras.push_dir = config.lora_push_dir
    loras.on_write = getattr(runner, "broadcast_lora_slot", None)  # a TP group's rank 0: each rank writes its share
    if kv_caches is not None:
        add_lora_graphs(runner, loras.slots, kv_caches)
    for name, path in (config.lora_modules or {}).items():
        loras.load(name, path)
    return loras


def allowed_lora_dirs(config: "InferenceConfig") -> list[str]:
    """Where the fleet's LOAD_LORA may read: ``lora_allowed_dirs``, else the directories holding the
    ``lora_modules`` adapters, else nowhere."""
    if config.lora_allowed_dirs is not None:
        return list(config.lora_allowed_dirs)
    return sorted({str(Path(path).parent) for path in (config.lora_modules or {}).values()})


def require(loras: EngineLoras | None) -> EngineLoras:
    """An engine's adapters; raises :class:`LoraAdapterError` when it was started without ``enable_lora``."""
    if loras is None:
        raise LoraAdapterError("LoRA adapters need an engine started with enable_lora")
    return loras


def admit_request(loras: EngineLoras | None, params: "SamplingParams") -> Registration | None:
    """The adapter registration a request runs under, None for the base model. Raises :class:`LoraAdapterError`
    with the reason it cannot run; its slot comes later (:class:`.lora_queue.LoraQueue`)."""
    if params.lora_name is None:
        return None
    return require(loras).resolve(params.lora_name, params.lora_path)


def lora_report(loras: EngineLoras | None, running: Iterable["Sequence"], waiting: Iterable["Sequence"]
                ) -> dict[str, object] | None:
    """What the heartbeat's ``metrics`` says about adapters (vLLM's ``lora_requests_info``): the slots, and the
    adapters of the running and of the waiting requests, by name; None for an engine without ``enable_lora``."""
    if loras is None:
        return None

    def names(sequences: Iterable["Sequence"]) -> list[str]:
        return sorted({n for s in sequences if (n := s.sampling_params.lora_name) is not None})

    return {"max_loras": loras.slots.max_loras, "running": names(running), "waiting": names(waiting)}
