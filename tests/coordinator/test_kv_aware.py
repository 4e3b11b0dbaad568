"""``--routing kv_aware``: the coordinator's KV index, fed by the engines' KV events (KV_EVENTS over their links),
routes a prompt to the engine that holds its blocks, against load; an engine whose events lag or were lost is routed
by load alone; a refit or a departure drops an engine's entries."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from megatron_serve.coordinator.kv_aware import KVAware
from megatron_serve.coordinator.kv_index import KVIndex
from megatron_serve.engine.kv.events import BlockOrigin, KVEventLog
from megatron_serve.wire.kv_events import MEDIUM_DEVICE, MEDIUM_HOST
from megatron_serve.wire.messages import Heartbeat, KVEvents, Submit
from megatron_serve.wire.prefix_hash import ROOT_HASH, block_hashes, epoch_root
from megatron_serve.wire.protocol import Header

from .core_harness import CoreHarness

BS = 4
C = b"client"


class EngineSide:
    """An engine's event log, its batches sent to the harness's coordinator as its process sends them."""

    def __init__(self, h: CoreHarness, identity: bytes, engine_id: str) -> None:
        self.h, self.identity, self.engine_id = h, identity, engine_id
        self.log = KVEventLog(BS)
        self.lost: set[int] = set()  # seqs not delivered (a lost frame)
        self.log.attach(self._send)

    def _send(self, seq: int, payload: bytes) -> None:
        if seq not in self.lost:
            self.h.send(self.identity, Header.KV_EVENTS, KVEvents(engine_id=self.engine_id, seq=seq,
                                                                  batch=msgspec.Raw(payload)))

    def store(self, prompt: list[int], medium: str = MEDIUM_DEVICE, epoch: int = 0) -> list[int]:
        hashes = block_hashes(prompt[: (len(prompt) - 1) // BS * BS], BS, epoch_root(ROOT_HASH, epoch))
        for index, block_hash in enumerate(hashes):
            tokens = tuple(prompt[index * BS:(index + 1) * BS])
            self.log.stored(medium, block_hash, BlockOrigin(hashes[index - 1] if index else None, tokens))
        self.log.flush()
        return hashes

    def remove(self, hashes: list[int], medium: str = MEDIUM_DEVICE) -> None:
        self.log.removed(medium, hashes)
        self.log.flush()


def fleet(**options) -> tuple[CoreHarness, list[EngineSide]]:
    h = CoreHarness(routing="kv_aware", **options)
    sides = []
    for group in range(3):
        identity = f"engine{group}".encode()
        engine_id = h.engine(identity, group=group, capacity=8, block_size=BS, prefix_caching=True)
        sides.append(EngineSide(h, identity, engine_id))
    h.client(C)
    return h, sides


def route(h: CoreHarness, sides: list[EngineSide], crid: str, prompt: list[int]) -> int:
    """Submit ``prompt``; the group it was sent to."""
    h.send(C, Header.SUBMIT, Submit(client_request_id=crid, prompt=prompt,
                                    sampling_params=msgspec.Raw(msgspec.msgpack.encode({"num_tokens_to_generate": 2}))))
    sent = [i for i, side in enumerate(sides) if h.take(side.identity, Header.ENGINE_SUBMIT)]
    assert len(sent) == 1
    return sent[0]


def prompt_of(start: int, blocks: int = 6) -> list[int]:
    return list(range(start, start + blocks * BS + 1))


def test_a_prompt_goes_where_its_blocks_are_and_a_storm_that_evicts_them_moves_it():
    h, sides = fleet()
    prompt = prompt_of(100)
    held = sides[2].store(prompt)
    sides[1].store(prompt[: 2 * BS + 1])  # a shorter match elsewhere
    assert route(h, sides, "a", prompt) == 2
    assert h.core.dispatcher.policy.hit_blocks == 6
    sides[2].remove(held)  # an eviction storm on engine 2: its events say so
    sides[1].store(prompt)
    assert route(h, sides, "b", prompt) == 1  # routed-prefix memory would still send it to engine 2
    host = sides[0].store(prompt_of(500), MEDIUM_HOST)  # a prefix in a host tier is found there too
    assert route(h, sides, "c", prompt_of(500)) == 0
    assert h.core.dispatcher.kv_index.match(sides[0].engine_id, host) == (6, pytest.approx(6 * 0.8))


def test_an_engine_whose_events_lag_or_were_lost_is_routed_by_load_alone():
    h, sides = fleet()
    prompt = prompt_of(200)
    sides[1].store(prompt)
    # its heartbeat names a batch the coordinator has not seen: behind, and for longer than the lag allowed
    h.send(sides[1].identity, Header.HEARTBEAT, Heartbeat(engine_id=sides[1].engine_id,
                                                          stats={"kv_events_seq": sides[1].log.seq_of(sides[1]._send) + 5}))
    assert h.core.dispatcher.kv_index.trusted(sides[1].engine_id, h.now)
    assert not h.core.dispatcher.kv_index.trusted(sides[1].engine_id, h.now + 10.0)
    sides[2].store(prompt)
    sides[2].lost.add(sides[2].log.seq_of(sides[2]._send) + 1)  # the next batch never arrives
    sides[2].store(prompt_of(900))
    sides[2].store(prompt_of(950))  # seq skips one: engine 2's entries are not trusted any more
    assert not h.core.dispatcher.kv_index.trusted(sides[2].engine_id, h.now) and h.core.dispatcher.kv_index.lost == 1
    sides[2].log.cleared()  # its next clear makes it whole again
    sides[2].log.flush()
    assert h.core.dispatcher.kv_index.trusted(sides[2].engine_id, h.now)


def test_a_refit_and_a_departure_drop_an_engines_entries():
    h, sides = fleet()
    prompt = prompt_of(300)
    sides[0].store(prompt)
    assert h.core.dispatcher.kv_index.size(sides[0].engine_id) == 6
    h.core.dispatcher.policy.forget(sides[0].engine_id)  # what the coordinator does at a refit
    assert h.core.dispatcher.kv_index.size(sides[0].engine_id) == 0
    sides[0].log.cleared()  # the engine's AllBlocksCleared follows
    sides[0].log.flush()
    new_epoch = sides[0].store(prompt, epoch=1)  # blocks of the new weights: other hashes
    assert not set(new_epoch) & set(block_hashes(prompt[:6 * BS], BS))
    h.core.remove_engine(h.core.members.engines[sides[1].engine_id], "test")
    assert sides[1].engine_id not in h.core.dispatcher.kv_index.engines


def test_temperature_spreads_a_hot_prefix_and_zero_keeps_it():
    index = KVIndex()
    from types import SimpleNamespace  # noqa: PLC0415

    engines = [SimpleNamespace(engine_id=f"e{i}", group=i, capacity=8, kv_blocks_free=64, kv_blocks_total=64,
                               stats={}, info={"block_size": BS, "prefix_caching": True}, load=0, epoch=0)
               for i in range(2)]
    log = KVEventLog(BS)
    log.attach(lambda seq, payload: index.apply("e0", seq, payload))
    prompt = prompt_of(0, 4)
    for i, block_hash in enumerate(block_hashes(prompt[:4 * BS], BS)):
        log.stored(MEDIUM_DEVICE, block_hash, BlockOrigin(None, tuple(prompt[i * BS:(i + 1) * BS])))
    log.flush()
    request = SimpleNamespace(request_id="r", prefix_keys=prompt, prefix_root=ROOT_HASH)
    cold = KVAware(index)
    assert {cold.select(request, engines).engine_id for _ in range(20)} == {"e0"}
    warm = KVAware(index, temperature=5.0, seed=0)
    assert {warm.select(request, engines).engine_id for _ in range(50)} == {"e0", "e1"}
    with pytest.raises(ValueError):
        KVAware(index, temperature=-1)


def test_a_burst_of_one_prefix_stays_on_one_engine_before_its_events_arrive_and_the_guess_expires():
    h, sides = fleet()
    prompt = prompt_of(700)
    first = route(h, sides, "p0", prompt)  # no engine has said anything of it yet
    assert route(h, sides, "p1", prompt) == first  # the blocks on their way count: not computed a second time
    assert h.core.dispatcher.policy.hit_blocks == 6
    control = KVAware(h.core.dispatcher.kv_index, pending_s=0.0)  # without them the next goes by load alone
    views = [h.core.members.engines[side.engine_id] for side in sides]
    request = SimpleNamespace(request_id="c", params=None, prefix_keys=prompt, prefix_root=ROOT_HASH)
    assert control.select(request, views).group != first
    h.core.dispatcher.kv_index.now += 10.0  # no event said it was stored: the guess expires
    routing = h.core.dispatcher
    assert routing.policy.match(sides[first].engine_id, block_hashes(prompt[:6 * BS], BS), routing.kv_index.now) == (0, 0)
    with pytest.raises(ValueError, match="pending_s"):
        KVAware(h.core.dispatcher.kv_index, pending_s=-1)
