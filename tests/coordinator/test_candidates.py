"""The candidates' heap answers what a scan of every engine answers (least_loaded's choice among the usable engines
with room), through random assignments, finishes, heartbeats that move free blocks, draining and registrations."""

from __future__ import annotations

import random

from megatron_serve.coordinator.candidates import Candidates
from megatron_serve.coordinator.peers import EngineRecord
from megatron_serve.coordinator.routing import load_key


def scan(engines: dict[str, EngineRecord], candidates: Candidates) -> EngineRecord | None:
    """The old way: list every usable engine with room, take the least loaded (the first of equals)."""
    pool = [e for e in engines.values() if candidates.room(e) and candidates.usable(e)]
    return min(pool, key=load_key) if pool else None


def test_the_heap_chooses_as_a_scan_of_every_engine():
    rng = random.Random(7)
    engines: dict[str, EngineRecord] = {}
    registrations = 0

    def register() -> None:
        nonlocal registrations
        registrations += 1
        engine_id = f"e{registrations}"
        # few groups and capacities, so that equal keys are common and the tie-break is exercised
        engines[engine_id] = EngineRecord(engine_id=engine_id, identity=engine_id.encode(), group=rng.randrange(4),
                                          capacity=rng.choice([1, 2, 4]), info={}, kv_blocks_total=8,
                                          kv_blocks_free=rng.randrange(9))

    for _ in range(40):
        register()
    candidates = Candidates(lambda e: max(1, int(e.capacity * 1.5)), lambda e: not e.draining)
    serial = 0
    for step in range(3000):
        candidates.refresh(engines, (registrations, len(engines)))
        expected = scan(engines, candidates)
        assert candidates.least() is expected, f"step {step}"
        action = rng.random()
        if action < 0.45 and expected is not None:  # dispatch sends to the chosen engine and files it again
            serial += 1
            expected.assigned.add(f"r{serial}")
            candidates.file(expected)
        elif action < 0.8:  # a request finishes somewhere (its Assigned reports the engine)
            busy = [e for e in engines.values() if e.assigned]
            if busy:
                engine = rng.choice(busy)
                engine.assigned.discard(next(iter(engine.assigned)))
        elif action < 0.95:  # a heartbeat moves an engine's free blocks
            engine = rng.choice(list(engines.values()))
            engine.kv_blocks_free = rng.randrange(9)
            candidates.blocks_changed(engine)
        elif action < 0.97:
            rng.choice(list(engines.values())).draining = True
        elif action < 0.985:
            register()
        else:
            del engines[rng.choice(list(engines))]
