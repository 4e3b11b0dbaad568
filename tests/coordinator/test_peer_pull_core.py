"""The coordinator pairs an engine that registers after a trainer's refit with a donor (weights.peer_pull), no sockets.

A donor is a live engine of the joiner's layout (``info.weights_layout``) and its number of ranks (a group pulls rank
to rank), at the fleet's epoch from the trainer, with a peer store: it gets ``PEER_WEIGHTS`` and the joiner a
HELLO_ACK whose ``refit`` names it, with one random prefix for both. Any other joiner (another layout, another number
of ranks, no donor with a store) gets no ``peer`` and no requests until the next refit, as before.
"""

from __future__ import annotations

from megatron_serve.wire.messages import Hello, PeerShare
from megatron_serve.wire.handshake import PROTOCOL_VERSION
from megatron_serve.wire.protocol import Header

from .core_harness import CoreHarness

TRAINER = "rendezvous://10.0.0.9:4000"


def hello(harness: CoreHarness, identity: bytes, group: int, **info) -> object:
    harness.send(identity, Header.HELLO, Hello(role="engine", engine_group=group, capacity=8,
                                               info={"kv_blocks_total": 64, "model": "/m", **info}, protocol=PROTOCOL_VERSION))
    return harness.take(identity, Header.HELLO_ACK)[-1]


def fleet_on_trainer_weights(**donor_info) -> tuple[CoreHarness, str]:
    """A coordinator (model /m) that adopted epoch 3 from the trainer through its first engine, the donor."""
    harness = CoreHarness(model="/m")
    info = {"weights_layout": "L", "epoch": 3, "weights": TRAINER, "peer_store": "10.0.0.1:7000", **donor_info}
    donor = hello(harness, b"donor", 0, **info).engine_id
    assert harness.core.weights.epoch == 3 and harness.core.weights.source == TRAINER
    return harness, donor


def test_a_joiner_of_the_donors_layout_pulls_from_it():
    harness, donor = fleet_on_trainer_weights()
    ack = hello(harness, b"joiner", 1, weights_layout="L", epoch=0, weights="/m")
    peer = ack.refit["peer"]
    assert ack.refit["source"] == TRAINER and ack.refit["epoch"] == 3
    assert peer["address"] == "10.0.0.1:7000" and peer["engine_id"] == donor and len(peer["prefix"]) >= 32
    [ask] = harness.take(b"donor", Header.PEER_WEIGHTS)
    assert isinstance(ask, PeerShare)
    assert (ask.engine_id, ask.prefix, ask.epoch) == (ack.engine_id, peer["prefix"], 3)
    assert harness.core.members.engines[ack.engine_id].epoch == 3  # it exits if the pull fails


def test_no_pull_without_a_donor_of_the_same_layout():
    harness, _ = fleet_on_trainer_weights()
    other_layout = hello(harness, b"other", 1, weights_layout="M", epoch=0, weights="/m")
    group = hello(harness, b"group", 2, weights_layout="L", tensor_parallel_size=2, epoch=0, weights="/m")  # 2 ranks
    older = hello(harness, b"older", 3, epoch=0, weights="/m")  # an engine that says no layout
    assert [other_layout.refit, group.refit, older.refit] == [None, None, None]
    assert harness.take(b"donor", Header.PEER_WEIGHTS) == []
    assert harness.core.members.engines[other_layout.engine_id].epoch == 0


def test_no_pull_from_an_engine_without_a_peer_store():
    harness, _ = fleet_on_trainer_weights(peer_store=None)
    assert hello(harness, b"joiner", 1, weights_layout="L", epoch=0, weights="/m").refit is None
    assert harness.take(b"donor", Header.PEER_WEIGHTS) == []


def test_a_group_pulls_from_a_donor_group_of_as_many_ranks():
    harness, single = fleet_on_trainer_weights()
    stages = {"pipeline_parallel_size": 2, "weights_layout": "P"}
    donor = hello(harness, b"donor-pp", 1, epoch=3, weights=TRAINER, peer_store="10.0.0.2:7000", **stages).engine_id
    ack = hello(harness, b"joiner-pp", 2, epoch=0, weights="/m", **stages)
    assert ack.refit["peer"]["engine_id"] == donor and ack.refit["peer"]["address"] == "10.0.0.2:7000"
    [ask] = harness.take(b"donor-pp", Header.PEER_WEIGHTS)
    assert ask.prefix == ack.refit["peer"]["prefix"] and harness.take(b"donor", Header.PEER_WEIGHTS) == []
