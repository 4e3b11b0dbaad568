"""A REFIT whose weights come from a trainer (a rendezvous), in the coordinator's core without sockets.

What the coordinator decides: each engine's ranks in the transfer group, when the fleet's epoch
changes, what a transfer that broke leaves (engines stay; UNPAUSE refused while any holds a mix),
and where requests go once an engine joins that lacks the trainer's weights.
"""

from __future__ import annotations

import msgspec

from megatron_serve.wire.messages import (Control, ControlAck, Hello, LoraPush, PieceSpec, Refit, Rendezvous, Submit,
                                         TensorSpec)
from megatron_serve.wire.handshake import PROTOCOL_VERSION
from megatron_serve.wire.protocol import Header

from .core_harness import CoreHarness
from .test_core import status

C, E1, E2, E3 = b"client", b"engine-1", b"engine-2", b"engine-3"
MANIFEST = [TensorSpec("model.norm.weight", (64,), "float32")]


def rendezvous(**changes) -> Rendezvous:
    return msgspec.structs.replace(Rendezvous(address="127.0.0.1:4000", prefix="0" * 32, backend="gloo",
                                              bucket_bytes=1 << 20, manifest=MANIFEST), **changes)


def paused_fleet() -> tuple[CoreHarness, str, str]:
    h = CoreHarness(heartbeat_timeout=1000.0)
    h.client(C)
    e1 = h.engine(E1, group=0)
    e2 = h.engine(E2, group=1, tensor_parallel_size=2)
    h.send(C, Header.PAUSE, Control(control_id="p"))
    for peer in (E1, E2):
        h.send(peer, Header.CONTROL_ACK, ControlAck(control_id="p#0", state="PAUSED"))
    assert h.take(C, Header.CONTROL_ACK)
    return h, e1, e2


def verified(h: CoreHarness, control_id: str, epoch: int | None, rv: Rendezvous,
             peers: tuple[bytes, ...] = (E1, E2)) -> list[Refit]:
    """Send a trainer refit of ``rv``: every engine of ``peers`` gets the verify step and passes it; their load
    steps."""
    h.send(C, Header.REFIT, Refit(control_id=control_id, source="rendezvous://127.0.0.1:4000", epoch=epoch,
                                  rendezvous=rv))
    for peer in peers:
        assert h.take(peer, Header.REFIT)[0].phase == "verify"
        h.send(peer, Header.CONTROL_ACK, ControlAck(control_id=f"{control_id}#0", state="PAUSED"))
    return [h.take(peer, Header.REFIT)[0] for peer in peers]


def transfer(h: CoreHarness, control_id: str, epoch: int, outcomes: dict[bytes, dict]) -> list[Refit]:
    """Run one trainer refit: every engine verifies, then acknowledges its load with ``outcomes[peer]``."""
    loads = verified(h, control_id, epoch, rendezvous(), tuple(outcomes))
    for peer, detail in outcomes.items():
        h.send(peer, Header.CONTROL_ACK, ControlAck(control_id=f"{control_id}#1", state="PAUSED", detail=detail))
    return loads


def test_each_engine_gets_its_ranks_and_the_epoch_changes_once_all_loaded():
    h, e1, e2 = paused_fleet()
    h.send(C, Header.REFIT, Refit(control_id="r", source="rendezvous://127.0.0.1:4000", epoch=4,
                                  rendezvous=rendezvous()))
    verify = h.take(E1, Header.REFIT)[0]
    assert verify.phase == "verify" and verify.rendezvous.manifest == MANIFEST and verify.rendezvous.world_size is None
    assert h.take(E2, Header.REFIT)[0].phase == "verify"
    for peer in (E1, E2):
        h.send(peer, Header.CONTROL_ACK, ControlAck(control_id="r#0", state="PAUSED"))
    load1, load2 = h.take(E1, Header.REFIT)[0], h.take(E2, Header.REFIT)[0]
    # the sender is rank 0; group 0 (one rank) is rank 1; group 1 (tensor-parallel 2) ranks 2 and 3
    assert (load1.phase, load1.rendezvous.world_size, load1.rendezvous.rank_offset) == ("load", 4, 1)
    assert (load2.rendezvous.world_size, load2.rendezvous.rank_offset) == (4, 2)
    h.send(E1, Header.CONTROL_ACK, ControlAck(control_id="r#1", state="PAUSED", detail={"epoch": 4}))
    assert h.core.weights.epoch == 0  # not before every engine loaded
    h.send(E2, Header.CONTROL_ACK, ControlAck(control_id="r#1", state="PAUSED", detail={"epoch": 4}))
    ack = h.take(C, Header.CONTROL_ACK)[0]
    assert ack.detail["epoch"] == 4 and ack.detail["engines"][e2]["ranks"] == [2, 3]
    assert status(h).epoch == 4 and status(h).weights == "rendezvous://127.0.0.1:4000" and status(h).refits == 1


def test_a_broken_transfer_keeps_the_engines_and_refuses_unpause_until_a_refit_completes():
    h, e1, e2 = paused_fleet()
    broken = {"error": "the transfer broke at bucket 2: Connection reset by peer", "epoch": -1,
              "weights_intact": False, "replaced": 3}
    transfer(h, "r", 1, {E1: broken, E2: {"error": "the transfer broke at bucket 1", "epoch": 0,
                                           "weights_intact": True, "replaced": 0}})
    error = h.take(C, Header.ERROR)[0]
    assert error.code == "refit_failed" and "bucket 2" in error.message
    assert f"engine(s) {e1} hold incomplete weights" in error.message and "UNPAUSE is refused" in error.message
    assert error.detail["engines"][e1]["replaced"] == 3 and error.detail["incomplete_weights"] == [e1]
    reply = status(h)
    assert len(reply.engines) == 2 and reply.incomplete_weights == [e1] and reply.epoch == 0

    h.send(C, Header.UNPAUSE, Control(control_id="u"))
    refused = h.take(C, Header.ERROR)[0]
    assert refused.code == "weights_incomplete" and e1 in refused.message and "REFIT first" in refused.message
    assert h.core.lifecycle.state.value == "PAUSED" and not h.take(E1, Header.UNPAUSE)

    transfer(h, "r2", 2, {E1: {"epoch": 2}, E2: {"epoch": 2}})
    assert h.take(C, Header.CONTROL_ACK)[0].detail["epoch"] == 2
    h.send(C, Header.UNPAUSE, Control(control_id="u2"))
    assert h.take(E1, Header.UNPAUSE) and status(h).incomplete_weights == []


def test_a_transfer_that_broke_before_any_weight_changed_leaves_the_fleet_serving():
    h, e1, e2 = paused_fleet()
    intact = {"error": "only 1 engine rank(s) joined", "epoch": 0, "weights_intact": True, "replaced": 0}
    transfer(h, "r", 1, {E1: intact, E2: intact})
    error = h.take(C, Header.ERROR)[0]
    assert "no weights were changed: the fleet keeps serving epoch 0" in error.message
    h.send(C, Header.UNPAUSE, Control(control_id="u"))
    for peer in (E1, E2):
        h.send(peer, Header.CONTROL_ACK, ControlAck(control_id="u#0", state="RUNNING"))
    assert h.take(C, Header.CONTROL_ACK)[0].state == "RUNNING"


def test_an_engine_that_joins_without_the_trainers_weights_gets_no_requests_until_a_refit_includes_it():
    h, e1, e2 = paused_fleet()
    transfer(h, "r", 3, {E1: {"epoch": 3}, E2: {"epoch": 3}})
    h.take(C, Header.CONTROL_ACK)
    h.send(C, Header.UNPAUSE, Control(control_id="u"))
    for peer in (E1, E2):
        h.send(peer, Header.CONTROL_ACK, ControlAck(control_id="u#0", state="RUNNING"))
    h.send(E3, Header.HELLO, Hello(
        role="engine", engine_group=5, capacity=8, info={"kv_blocks_total": 64, "epoch": 0}, protocol=PROTOCOL_VERSION))
    hello_ack = h.take(E3, Header.HELLO_ACK)[0]
    assert hello_ack.refit is None  # nothing to load from: it waits for the next refit
    e3 = hello_ack.engine_id
    assert status(h).epoch_mismatch == [e3]
    params = msgspec.Raw(msgspec.msgpack.encode({"num_tokens_to_generate": 2}))
    for i in range(12):
        h.send(C, Header.SUBMIT, Submit(client_request_id=f"q{i}", prompt=[1, 2], sampling_params=params))
    assert not h.take(E3, Header.ENGINE_SUBMIT)
    assert len(h.take(E1, Header.ENGINE_SUBMIT)) + len(h.take(E2, Header.ENGINE_SUBMIT)) == 12

    h.send(C, Header.PAUSE, Control(control_id="p2"))
    for peer in (E1, E2, E3):
        h.send(peer, Header.CONTROL_ACK, ControlAck(control_id="p2#0", state="PAUSED"))
    loads = transfer(h, "r2", 4, {E1: {"epoch": 4}, E2: {"epoch": 4}, E3: {"epoch": 4}})
    assert [load.rendezvous.world_size for load in loads] == [5, 5, 5]  # 1 + 1 + 2 + 1
    assert h.take(C, Header.CONTROL_ACK) and status(h).epoch_mismatch == []


def test_a_rendezvous_that_cannot_work_is_refused_at_once():
    h, _, _ = paused_fleet()
    for control_id, bad, why in [("b1", rendezvous(backend="mpi"), "backend must be one of gloo, nccl"),
                                 ("b2", rendezvous(manifest=[]), "manifest is empty"),
                                 ("b3", rendezvous(address="nowhere"), "must be host:port"),
                                 ("b4", rendezvous(manifest=[TensorSpec("x", (2,), "int8")]), "dtype 'int8'"),
                                 ("b5", rendezvous(prefix="guessable"), "prefix must be a random value")]:
        h.send(C, Header.REFIT, Refit(control_id=control_id, source="rendezvous://x", rendezvous=bad))
        error = h.take(C, Header.ERROR)[0]
        assert error.code == "invalid_request" and why in error.message, error.message
    assert not h.take(E1, Header.REFIT)


def test_an_adapter_push_takes_one_rank_per_tensor_parallel_group():
    """A LoRA push goes to each group's rank 0 only (it sends the other ranks their shares at slot writes), so
    the transfer group has one rank per engine: the sender and two engines, whatever their TP sizes."""
    h, e1, e2 = paused_fleet()
    push = LoraPush(name="a", version=1, rank=4, alpha=8.0)
    manifest = [TensorSpec("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", (4, 64), "float32")]
    load1, load2 = verified(h, "l", 0, rendezvous(manifest=manifest, lora=push))
    assert (load1.rendezvous.world_size, load1.rendezvous.rank_offset) == (3, 1)
    assert (load2.rendezvous.world_size, load2.rendezvous.rank_offset) == (3, 2)


def test_a_sharded_trainer_takes_the_first_ranks_and_bad_pieces_are_refused_at_once():
    h, _, _ = paused_fleet()
    pieces = [PieceSpec("model.norm.weight", 0, (0,), (32,)), PieceSpec("model.norm.weight", 1, (32,), (32,))]
    load1, load2 = verified(h, "s", 2, rendezvous(pieces=pieces, senders=2))
    # trainer ranks 0 and 1; group 0 is rank 2; group 1 (tensor-parallel 2) ranks 3 and 4
    assert (load1.rendezvous.world_size, load1.rendezvous.rank_offset) == (5, 2)
    assert (load2.rendezvous.world_size, load2.rendezvous.rank_offset) == (5, 3)
    assert load1.rendezvous.pieces == pieces

    for bad, why in [(rendezvous(pieces=[PieceSpec("model.norm.weight", 2, (0,), (64,))], senders=2), "outside 0..1"),
                     (rendezvous(senders=2), "need pieces")]:
        h.send(C, Header.REFIT, Refit(control_id="bad", source="rendezvous://127.0.0.1:4000", rendezvous=bad))
        error = h.take(C, Header.ERROR)[-1]
        assert why in error.message
